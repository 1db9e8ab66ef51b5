package ibverbs

import (
	"log/slog"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// Config selects the host device.
type Config struct {
	// Device is the RDMA device name (ibv_devices, rdma link show), e.g.
	// "mlx5_0" or "rxe0".
	Device string
	// Port is the device port (default 1).
	Port uint8
	// Logger is the provider's logger; nil means slog.Default().
	Logger *slog.Logger
}

// HostGID is one entry of the host port's GID table.
type HostGID struct {
	Index int
	hostverbs.GIDEntry
}
