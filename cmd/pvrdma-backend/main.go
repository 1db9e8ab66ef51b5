// Command pvrdma-backend is the host daemon that emulates VMware's PVRDMA
// device for QEMU VMs over vfio-user.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "pvrdma-backend: not built yet")
	os.Exit(2)
}
