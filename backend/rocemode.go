package backend

import (
	"errors"
	"fmt"
	"strings"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
)

// ErrBadRoCEMode: a RoCE mode does not parse, or the fabric cannot carry
// it (RoCE v1 in IP mode).
var ErrBadRoCEMode = errors.New("bad RoCE mode")

// ParseRoCEMode parses a RoCE mode: "v1" or "v2" (also "1", "2", and
// rdma_cm's configfs spellings "IB/RoCE v1" and "RoCE v2"). Empty means 0:
// the fabric's default.
func ParseRoCEMode(s string) (hostverbs.GIDType, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "":
		return 0, nil
	case "v1", "1", "rocev1", "roce v1", "ib/roce v1":
		return hostverbs.GIDTypeRoCEv1, nil
	case "v2", "2", "rocev2", "roce v2":
		return hostverbs.GIDTypeRoCEv2, nil
	}
	return 0, fmt.Errorf("RoCE mode %q: want v1 or v2: %w", s, ErrBadRoCEMode)
}

// RoCEModeName is the short name ParseRoCEMode takes: "v1" or "v2".
func RoCEModeName(t hostverbs.GIDType) string {
	if t == hostverbs.GIDTypeRoCEv1 {
		return "v1"
	}
	return "v2"
}

// checkRoCEMode reports whether the fabric can carry a device of mode m:
// RoCE v1 has no IP header, so IP mode cannot route it.
func (c FabricConfig) checkRoCEMode(m hostverbs.GIDType) error {
	if m == hostverbs.GIDTypeRoCEv1 && c.Netdev != "" {
		return fmt.Errorf("RoCE v1 is not routable (no IP header): IP mode (fabric netdev %s) carries RoCE v2 only; use L2 mode (a fabric bridge) for v1 VMs: %w", c.Netdev, ErrBadRoCEMode)
	}
	if m == hostverbs.GIDTypeRoCEv1 && c.Transport() == "ibverbs" {
		return fmt.Errorf("RoCE v1 through the ibverbs relay is not supported (the relay works in IP mode): %w", ErrBadRoCEMode)
	}
	return nil
}
