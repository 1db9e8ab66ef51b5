package backend

import (
	"encoding/json"
	"net"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestNodeGUIDIsEUI64(t *testing.T) {
	mac, _ := net.ParseMAC("52:54:00:12:34:56")
	// The value the stock driver was seen to report for this MAC.
	assert.Equal(t, uint64(0x505400fffe123456), NodeGUID(mac))
	assert.Equal(t, uint64(0), NodeGUID(net.HardwareAddr{1, 2}))
}

func TestDefaultMACStableAndDistinct(t *testing.T) {
	a, b := DefaultMAC("vm1"), DefaultMAC("vm2")
	assert.Equal(t, a, DefaultMAC("vm1"))
	assert.NotEqual(t, a, b)
	assert.Equal(t, net.HardwareAddr{0x52, 0x54, 0x00}, a[:3])
}

func TestCheckVMName(t *testing.T) {
	for _, ok := range []string{"vm1", "a", "web-01.prod", "_x", "Control", "control1", "vm1.qmp"} {
		assert.NoError(t, CheckVMName(ok), ok)
	}
	for _, bad := range []string{"", ".hidden", "a/b", "../x", "sp ace", string(make([]byte, 65)), "control"} {
		assert.ErrorIs(t, CheckVMName(bad), ErrBadVMName, "%q", bad)
	}
}

func TestQEMUArgs(t *testing.T) {
	mac, _ := net.ParseMAC("52:54:00:77:00:01")
	args, err := VMSpec{Name: "vm1", MAC: mac, Slot: 6, MemBytes: 1 << 30, Netdev: "n0", Socket: "/run/pvrdma/vm1.sock"}.QEMUArgs()
	require.NoError(t, err)
	require.Len(t, args, 12)
	assert.Equal(t, []string{"-m", "1024M",
		"-object", "memory-backend-memfd,id=pvrdma-ram,size=1024M,share=on,prealloc=on",
		"-machine", "q35,memory-backend=pvrdma-ram", "-overcommit", "mem-lock=on"}, args[:8])
	var nic, dev map[string]any
	require.NoError(t, json.Unmarshal([]byte(args[9]), &nic))
	require.NoError(t, json.Unmarshal([]byte(args[11]), &dev))
	assert.Equal(t, map[string]any{"driver": "vmxnet3", "netdev": "n0", "mac": "52:54:00:77:00:01", "addr": "06.0", "multifunction": true}, nic)
	assert.Equal(t, map[string]any{"driver": "vfio-user-pci", "addr": "06.1", "x-no-posted-writes": true,
		"socket": map[string]any{"type": "unix", "path": "/run/pvrdma/vm1.sock"}}, dev)

	_, err = VMSpec{Name: "vm1", Slot: 0, MemBytes: 1 << 30, Netdev: "n0", Socket: "s"}.QEMUArgs()
	assert.Error(t, err, "slot 0 of the root bus is the host bridge")
	_, err = VMSpec{Name: "vm1", Slot: 5, MemBytes: 1<<30 + 1, Netdev: "n0", Socket: "s"}.QEMUArgs()
	assert.Error(t, err)
	_, err = VMSpec{Name: "x/y", Slot: 5, MemBytes: 1 << 30, Netdev: "n0", Socket: "s"}.QEMUArgs()
	assert.ErrorIs(t, err, ErrBadVMName)
}

func TestParseVMFlagDoorbells(t *testing.T) {
	req, err := ParseVMFlag("vm1,doorbells=memory")
	if err != nil || req.Doorbells != "memory" {
		t.Fatalf("doorbells=memory: %+v %v", req, err)
	}
	req, err = ParseVMFlag("vm1")
	if err != nil || req.Doorbells != "" {
		t.Fatalf("default: %+v %v", req, err)
	}
	for _, bad := range []string{"vm1,doorbells=", "vm1,doorbells=mmio"} {
		if _, err := ParseVMFlag(bad); err == nil {
			t.Fatalf("%s accepted", bad)
		}
	}
}
