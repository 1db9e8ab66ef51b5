package backend

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type fakeController struct {
	mu  sync.Mutex
	vms map[string]VMStatus
}

func (f *fakeController) Status() Status {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := Status{Transport: "soft", Counters: map[string]uint64{"rx_packets": 3}}
	for _, v := range f.vms {
		st.VMs = append(st.VMs, v)
	}
	return st
}

func (f *fakeController) AddVM(r VMRequest) (VMStatus, error) {
	if err := CheckVMName(r.Name); err != nil {
		return VMStatus{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.vms[r.Name]; ok {
		return VMStatus{}, fmt.Errorf("%s: %w", r.Name, ErrVMExists)
	}
	v := VMStatus{Name: r.Name, MAC: DefaultMAC(r.Name).String(), Counters: map[string]uint64{"commands": 7},
		Resources: map[string]int{"qp": 2}}
	f.vms[r.Name] = v
	return v, nil
}

func (f *fakeController) RemoveVM(name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.vms[name]; !ok {
		return ErrNoVM
	}
	delete(f.vms, name)
	return nil
}

func TestControlSocketRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "control.sock")
	ln, err := ListenControl(path)
	require.NoError(t, err)
	srv := &http.Server{Handler: ControlHandler(&fakeController{vms: map[string]VMStatus{}})}
	go srv.Serve(ln)
	defer srv.Close()

	_, err = ListenControl(path)
	assert.ErrorContains(t, err, "another daemon", "a live daemon's socket is not stolen")

	ctx := context.Background()
	c := NewControlClient(path)
	v, err := c.AddVM(ctx, VMRequest{Name: "vm1"})
	require.NoError(t, err)
	assert.Equal(t, DefaultMAC("vm1").String(), v.MAC)
	_, err = c.AddVM(ctx, VMRequest{Name: "vm1"})
	assert.ErrorContains(t, err, "already registered")
	_, err = c.AddVM(ctx, VMRequest{Name: "../etc"})
	assert.ErrorContains(t, err, "VM name")
	st, err := c.Status(ctx)
	require.NoError(t, err)
	require.Len(t, st.VMs, 1)
	m, err := c.Metrics(ctx)
	require.NoError(t, err)
	mfs := parseMetrics(t, m)
	assert.Equal(t, []string{"event=commands,vm=vm1, 7"}, series(mfs["pvrdma_vm_events_total"]))
	assert.Equal(t, []string{"kind=qp,vm=vm1, 2"}, series(mfs["pvrdma_vm_resources"]))
	assert.Contains(t, m, `pvrdma_fabric_events_total{event="rx_packets"} 3`)
	require.NoError(t, c.RemoveVM(ctx, "vm1"))
	assert.ErrorContains(t, c.RemoveVM(ctx, "vm1"), "no such VM")

	srv.Close()
	ln2, err := ListenControl(path)
	require.NoError(t, err, "a stale socket of a dead daemon is replaced")
	ln2.Close()
}
