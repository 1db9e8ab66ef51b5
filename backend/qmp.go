package backend

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
)

// ErrRAMNotShared: the VM's RAM is not in a shared memory backend, so the
// device could not read guest memory in place.
var ErrRAMNotShared = errors.New("VM RAM is not a shared memory backend: start QEMU with " +
	"-object memory-backend-memfd,id=ram,size=<RAM>,share=on -machine memory-backend=ram -overcommit mem-lock=on")

// QMP is a QEMU monitor connection with deadlines. go-qemu's SocketMonitor
// has none (its Connect and Run block forever on a stuck QEMU), so every call
// runs under a timeout; a timed-out monitor is closed and must be redialled.
type QMP struct {
	mon     *qmp.SocketMonitor
	timeout time.Duration
}

// DialQMP connects to a QMP unix socket and completes the greeting and
// capabilities negotiation within timeout.
func DialQMP(ctx context.Context, path string, timeout time.Duration) (*QMP, error) {
	mon, err := qmp.NewSocketMonitor("unix", path, timeout)
	if err != nil {
		return nil, fmt.Errorf("qmp dial %s: %w", path, err)
	}
	q := &QMP{mon: mon, timeout: timeout}
	if err := q.bounded(ctx, mon.Connect); err != nil {
		return nil, fmt.Errorf("qmp connect %s: %w", path, err)
	}
	return q, nil
}

// bounded runs fn, giving up (and closing the monitor, which unblocks fn)
// when ctx ends or the timeout passes.
func (q *QMP) bounded(ctx context.Context, fn func() error) error {
	ctx, cancel := context.WithTimeout(ctx, q.timeout)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		_ = q.mon.Disconnect()
		<-done
		return fmt.Errorf("qmp: %w", ctx.Err())
	}
}

// Run executes one QMP command with arguments (any JSON-marshallable value,
// or nil) and returns the "return" member of the reply.
func (q *QMP) Run(ctx context.Context, execute string, args any) (json.RawMessage, error) {
	cmd, err := json.Marshal(qmp.Command{Execute: execute, Args: args})
	if err != nil {
		return nil, fmt.Errorf("qmp %s: %w", execute, err)
	}
	var raw []byte
	err = q.bounded(ctx, func() error {
		var rerr error
		raw, rerr = q.mon.Run(cmd)
		return rerr
	})
	if err != nil {
		return nil, fmt.Errorf("qmp %s: %w", execute, err)
	}
	var reply struct {
		Return json.RawMessage `json:"return"`
	}
	if err := json.Unmarshal(raw, &reply); err != nil {
		return nil, fmt.Errorf("qmp %s: bad reply %q: %w", execute, raw, err)
	}
	return reply.Return, nil
}

// Close closes the monitor connection.
func (q *QMP) Close() error { return q.mon.Disconnect() }

// memdev is one entry of query-memdev.
type memdev struct {
	ID    string `json:"id"`
	Size  uint64 `json:"size"`
	Share bool   `json:"share"`
}

// CheckSharedRAM fails with ErrRAMNotShared unless every memory backend of
// the VM is shared (and there is at least one: plain -m RAM is anonymous).
func (q *QMP) CheckSharedRAM(ctx context.Context) error {
	ret, err := q.Run(ctx, "query-memdev", nil)
	if err != nil {
		return err
	}
	var mds []memdev
	if err := json.Unmarshal(ret, &mds); err != nil {
		return fmt.Errorf("query-memdev: %w", err)
	}
	if len(mds) == 0 {
		return fmt.Errorf("no memory backend object: %w", ErrRAMNotShared)
	}
	for _, m := range mds {
		if !m.Share {
			return fmt.Errorf("memory backend %q: %w", m.ID, ErrRAMNotShared)
		}
	}
	return nil
}

// Attach hot-plugs the PVRDMA function and its paired vmxnet3 into a
// running VM. spec.Bus must name an empty hot-pluggable bus (a
// pcie-root-port on q35: the root bus refuses hot-plug). Function 1 goes
// first and function 0 last, because the guest scans a multifunction slot
// when function 0 appears. The backend must already listen on spec.Socket.
func Attach(ctx context.Context, q *QMP, spec VMSpec) error {
	if spec.Bus == "" {
		return errors.New("attach: a hot-pluggable bus (e.g. a pcie-root-port id) is required")
	}
	spec.Slot = 0 // a root port has one slot
	if err := spec.check(); err != nil {
		return fmt.Errorf("attach: %w", err)
	}
	if err := q.CheckSharedRAM(ctx); err != nil {
		return fmt.Errorf("attach: %w", err)
	}
	devID, nicID := "pvrdma-"+spec.Name, "pvrdma-nic-"+spec.Name
	if _, err := q.Run(ctx, "device_add", spec.DeviceJSON(devID)); err != nil {
		return fmt.Errorf("attach: add PVRDMA function: %w", err)
	}
	if _, err := q.Run(ctx, "device_add", spec.NICJSON(nicID)); err != nil {
		_, _ = q.Run(ctx, "device_del", map[string]any{"id": devID})
		return fmt.Errorf("attach: add vmxnet3: %w", err)
	}
	return nil
}
