package ibverbs

import "errors"

// Errors New and Open report; each message also says what to do.
var (
	// ErrNoLibrary: libibverbs cannot be loaded.
	ErrNoLibrary = errors.New("cannot load libibverbs")
	// ErrNoDevice: the named RDMA device does not exist.
	ErrNoDevice = errors.New("no such RDMA device")
	// ErrNoAccess: the kernel has the RDMA device but its verbs device node cannot be
	// opened (missing, or refused).
	ErrNoAccess = errors.New("RDMA device not accessible")
	// ErrPort: the port does not exist or is not usable.
	ErrPort = errors.New("RDMA port not usable")
	// ErrNotBuilt: this binary was built without cgo.
	ErrNotBuilt = errors.New("this binary was built without cgo: it has no ibverbs provider")
)
