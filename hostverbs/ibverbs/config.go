package ibverbs

import (
	"log/slog"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// Config selects the host device.
type Config struct {
	// Device is the RDMA device name (ibv_devices, rdma link show), e.g.
	// "mlx5_0" or "rxe0".
	Device string
	// Port is the device port (default 1).
	Port uint8
	// BusyPoll is how long a device's completion goroutine keeps polling
	// CQs that just completed work, unarmed, before it arms them and
	// waits for the next event. Completions that come meanwhile (typically
	// the answer to what just completed) are taken without an event, so
	// no thread is woken while a post is inside its system call (rxe
	// completes a loopback send there). Completions a poster takes from
	// its own post count as activity too. It costs that much CPU after
	// each burst of completions. 0: arm at once.
	BusyPoll time.Duration
	// Logger is the provider's logger; nil means slog.Default().
	Logger *slog.Logger
}

// HostGID is one entry of the host port's GID table.
type HostGID struct {
	Index int
	hostverbs.GIDEntry
}
