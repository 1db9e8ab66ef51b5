//go:build linux

package ibverbs

import (
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// ibUserMADRegisterAgent2 is _IOWR(0x1b, 4, struct ib_user_mad_reg_req2)
// (40 bytes), from <rdma/ib_user_mad.h>.
const ibUserMADRegisterAgent2 = 0xC0000000 | 40<<16 | 0x1b<<8 | 4

// registerCMAgent asks umad for the unsolicited MADs of the CM class
// (0x07, version 2) on QP1, as a user-space rdma_cm relay would have to.
func registerCMAgent(t *testing.T, dev string) error {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	var req [40]byte
	binary.LittleEndian.PutUint32(req[4:], 1) // qpn
	req[8], req[9] = 0x07, 2                  // mgmt_class CM, version 2
	for i := 16; i < 32; i++ {
		req[i] = 0xff // every method
	}
	_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), ibUserMADRegisterAgent2, uintptr(unsafe.Pointer(&req[0])))
	if e != 0 {
		return e
	}
	return nil
}

// TestUmadCMAgentVersusKernelCM records what relaying a guest's rdma_cm
// through the host's QP1 would meet (what QEMU's rdmacm-mux did): a
// user-space agent may take the CM class's MADs only while the host
// kernel's own CM (ib_cm, which rdma_cm loads) has not claimed them.
func TestUmadCMAgentVersusKernelCM(t *testing.T) {
	if os.Getenv("PVRDMA_IBDEV") == "" {
		t.Skip("PVRDMA_IBDEV is not set (the VM test runs this in a guest with rxe)")
	}
	if out, err := exec.Command("modprobe", "ib_umad").CombinedOutput(); err != nil {
		t.Fatalf("modprobe ib_umad: %v: %s", err, out)
	}
	const umad = "/dev/infiniband/umad0"
	if err := exec.Command("modprobe", "-r", "rdma_ucm", "rdma_cm", "iw_cm", "ib_cm").Run(); err != nil {
		t.Logf("ib_cm could not be unloaded first (in use?)")
	}
	without := registerCMAgent(t, umad)
	t.Logf("UMAD_CM without the kernel's ib_cm: %v", without)
	if out, err := exec.Command("modprobe", "ib_cm").CombinedOutput(); err != nil {
		t.Fatalf("modprobe ib_cm: %v: %s", err, out)
	}
	with := registerCMAgent(t, umad)
	t.Logf("UMAD_CM with the kernel's ib_cm loaded: %v", with)
	require.NoError(t, without, "a user agent takes the CM class while the kernel's CM is absent")
	require.True(t, errors.Is(with, unix.EINVAL) || errors.Is(with, unix.EBUSY), "the kernel's CM holds the class: %v", with)
}
