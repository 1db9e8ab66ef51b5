package main

import (
	"errors"
	"fmt"
	"io"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

// LibvirtHookPath is where the Debian package installs the libvirt hook
// (packaging/libvirt-hook), which runs `pvrdma-backend libvirt-hook`.
const LibvirtHookPath = "/etc/libvirt/hooks/qemu.d/pvrdma-backend"

// maxDomainXML bounds the domain XML the hook reads.
const maxDomainXML = 16 << 20

// runLibvirtHook is libvirt's qemu hook: arguments DOMAIN OPERATION
// SUB-OPERATION EXTRA, the domain XML on stdin. It exits non-zero, with
// the reason on stderr (libvirt shows it), for the operations it refuses
// (backend.LibvirtHook), and prints nothing on stdout (libvirt would take
// output of the migrate and restore operations as a new domain XML).
func runLibvirtHook(args []string, stdin io.Reader, stderr io.Writer) error {
	if len(args) < 2 {
		fmt.Fprintln(stderr, "usage: pvrdma-backend libvirt-hook DOMAIN OPERATION [SUB-OPERATION EXTRA] < domain.xml\n"+
			"Installed as "+LibvirtHookPath+"; refuses migrate and restore of domains with a PVRDMA (vfio-user-pci) device.")
		return errUsage
	}
	// Read the whole input whatever the operation: libvirt writes the
	// domain XML to every hook.
	xml, err := io.ReadAll(io.LimitReader(stdin, maxDomainXML+1))
	if err != nil {
		return fmt.Errorf("reading the domain XML: %w", err)
	}
	if len(xml) > maxDomainXML {
		_, _ = io.Copy(io.Discard, stdin)
		if backend.LibvirtHookOps[args[1]] {
			return errors.New("domain XML over 16 MiB: refused, since the device cannot be ruled out")
		}
		return nil
	}
	return backend.LibvirtHook(args[0], args[1], xml)
}
