//go:build linux && cgo

package ibverbs

/*
#cgo CFLAGS: -O2 -Wall -Wno-unused-function
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "pv.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

// LibraryName is the shared library the provider loads at run time.
const LibraryName = "libibverbs.so.1"

// lib is a loaded libibverbs.
type lib struct{ l *C.pv_lib }

// loadLib dlopens libibverbs; the error says what to install.
func loadLib() (*lib, error) {
	name := C.CString(LibraryName)
	defer C.free(unsafe.Pointer(name))
	var buf [512]C.char
	l := C.pv_load(name, &buf[0], C.size_t(len(buf)))
	if l == nil {
		return nil, fmt.Errorf("%w: %s (Debian: apt install libibverbs1 ibverbs-providers)", ErrNoLibrary, C.GoString(&buf[0]))
	}
	return &lib{l: l}, nil
}

func (l *lib) close() { C.pv_unload(l.l) }

// deviceNames lists the RDMA devices libibverbs sees.
func (l *lib) deviceNames() ([]string, error) {
	var buf [4096]C.char
	n, err := C.pv_device_names(l.l, &buf[0], C.size_t(len(buf)))
	if n < 0 {
		return nil, fmt.Errorf("ibv_get_device_list: %w", err)
	}
	s := C.GoStringN(&buf[0], n)
	return strings.FieldsFunc(s, func(r rune) bool { return r == 0 }), nil
}

// errnoErr turns a verbs call's failure into an error: a negative or
// positive errno return, or errno itself.
func errnoErr(what string, rc C.int, err error) error {
	if rc == 0 {
		return nil
	}
	if rc > 0 {
		err = syscall.Errno(rc)
	} else if rc < -1 {
		err = syscall.Errno(-rc)
	}
	if err == nil {
		err = errors.New("failed")
	}
	return fmt.Errorf("%s: %w", what, err)
}

// cgoSpin spends d in one cgo call (benchmarks).
func cgoSpin(d time.Duration) { C.pv_spin(C.long(d.Nanoseconds())) }
