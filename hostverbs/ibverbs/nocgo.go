//go:build !linux || !cgo

package ibverbs

import (
	"fmt"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// Provider is the relay; this build (no cgo) cannot make one.
type Provider struct{}

// New reports that this binary has no relay.
func New(cfg Config) (*Provider, error) {
	return nil, fmt.Errorf("ibverbs: %s: %w (build with CGO_ENABLED=1 and libibverbs-dev)", cfg.Device, ErrNotBuilt)
}

// Open is never reached: New fails.
func (p *Provider) Open(hostverbs.DeviceConfig) (hostverbs.Device, error) { return nil, ErrNotBuilt }

// Close does nothing.
func (p *Provider) Close() error { return nil }

// Name is empty.
func (p *Provider) Name() string { return "" }

// Port is 0.
func (p *Provider) Port() uint8 { return 0 }

// GIDTable fails.
func (p *Provider) GIDTable() ([]HostGID, error) { return nil, ErrNotBuilt }

// PortState fails.
func (p *Provider) PortState() (string, error) { return "", ErrNotBuilt }

// Built reports whether this binary has the relay (it needs cgo).
const Built = false
