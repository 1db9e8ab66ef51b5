package backend

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/ibverbs"
)

// createRXE makes the Soft-RoCE link name over netdev through the RDMA
// netlink family (what `rdma link add NAME type rxe netdev NETDEV` does)
// and waits for the device to appear. An existing link of that name is
// used as it is (created is false: the daemon will not remove it).
func createRXE(name, netdev string, log *slog.Logger) (created bool, err error) {
	if _, err := netlink.RdmaLinkByName(name); err == nil {
		log.Info("using the existing rxe link", "rdma_link", name)
		return false, nil
	}
	if _, err := netlink.LinkByName(netdev); err != nil {
		return false, fmt.Errorf("create rxe over %s: %w", netdev, err)
	}
	if err := netlink.RdmaLinkAdd(name, "rxe", netdev); err != nil {
		if errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.EINVAL) {
			return false, fmt.Errorf("create rxe link %s over %s: %w (is the rdma_rxe module available? modprobe rdma_rxe)", name, netdev, err)
		}
		return false, fmt.Errorf("create rxe link %s over %s: %w", name, netdev, err)
	}
	// The device appears in sysfs once registered; libibverbs lists it then.
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join("/sys/class/infiniband", name)); err == nil {
			break
		}
		if time.Now().After(deadline) {
			_ = netlink.RdmaLinkDel(name)
			return false, fmt.Errorf("rxe link %s over %s did not appear in /sys/class/infiniband", name, netdev)
		}
		time.Sleep(20 * time.Millisecond)
	}
	log.Info("created rxe link", "rdma_link", name, "netdev", netdev)
	return true, nil
}

// deleteRXE removes the rxe link the daemon created, if any.
func (f *fabric) deleteRXE() error {
	if f.rxe == "" {
		return nil
	}
	name := f.rxe
	f.rxe = ""
	if err := netlink.RdmaLinkDel(name); err != nil {
		return fmt.Errorf("remove rxe link %s: %w", name, err)
	}
	f.log.Info("removed rxe link", "rdma_link", name)
	return nil
}

// relayStatus describes the relay's host device for `status`.
func relayStatus(p *ibverbs.Provider, created bool) *HostDeviceStatus {
	st := &HostDeviceStatus{Name: p.Name(), Port: p.Port(), CreatedRXE: created}
	state, err := p.PortState()
	if err != nil {
		st.Error = err.Error()
		return st
	}
	st.State = state
	tbl, err := p.GIDTable()
	if err != nil {
		st.Error = err.Error()
		return st
	}
	for _, g := range tbl {
		st.GIDs = append(st.GIDs, fmt.Sprintf("%d %s %s", g.Index, g.GID, g.Type))
	}
	return st
}
