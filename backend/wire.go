package backend

import (
	"fmt"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft"
)

// newKernelWire opens the soft fabric's kernel UDP 4791 path on netdev and
// reports the netdev's MTU.
func newKernelWire(netdev string) (soft.Wire, int, error) {
	return nil, 0, fmt.Errorf("fabric netdev %s: the kernel wire is not available in this build", netdev)
}
