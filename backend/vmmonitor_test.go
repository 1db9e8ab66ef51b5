package backend

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// qmpPeer is a client on a VM's QMP socket speaking for QEMU: the daemon
// must treat it as untrusted (any peer of the socket group can connect).
type qmpPeer struct {
	t  *testing.T
	c  net.Conn
	rd *bufio.Reader
}

func dialQMPPeer(t *testing.T, path string) *qmpPeer {
	t.Helper()
	c, err := net.Dial("unix", path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(hangBound))
	return &qmpPeer{t: t, c: c, rd: bufio.NewReader(c)}
}

func (p *qmpPeer) send(s string) {
	p.t.Helper()
	_, err := fmt.Fprintln(p.c, s)
	require.NoError(p.t, err)
}

// next reads the daemon's next command; ok is false at EOF.
func (p *qmpPeer) next() (execute string, id json.RawMessage, ok bool) {
	p.t.Helper()
	line, err := p.rd.ReadBytes('\n')
	if err != nil {
		return "", nil, false
	}
	var cmd struct {
		Execute string          `json:"execute"`
		ID      json.RawMessage `json:"id"`
	}
	require.NoError(p.t, json.Unmarshal(line, &cmd), "%s", line)
	return cmd.Execute, cmd.ID, true
}

// expect reads the next command, checks its name and answers it.
func (p *qmpPeer) expect(execute, ret string) {
	p.t.Helper()
	got, id, ok := p.next()
	require.True(p.t, ok, "daemon closed the monitor before %s", execute)
	require.Equal(p.t, execute, got)
	if id == nil {
		p.send(`{"return": ` + ret + `}`)
		return
	}
	p.send(`{"return": ` + ret + `, "id": ` + string(id) + `}`)
}

// handshake plays QEMU's greeting and the guard's opening queries, with
// no migration and no job running.
func (p *qmpPeer) handshake() {
	p.t.Helper()
	p.send(`{"QMP": {"version": {"qemu": {"micro": 3, "minor": 1, "major": 11}, "package": ""}, "capabilities": ["oob"]}}`)
	p.expect("qmp_capabilities", `{}`)
	p.expect("migrate-set-capabilities", `{}`)
	p.expect("query-migrate", `{}`)
	p.expect("query-jobs", `[]`)
}

func vmStatus(t *testing.T, d *Daemon, name string) VMStatus {
	t.Helper()
	for _, v := range d.Status().VMs {
		if v.Name == name {
			return v
		}
	}
	t.Fatalf("no VM %s", name)
	return VMStatus{}
}

// TestQMPMonitorGuard: the daemon cancels a migration that runs when its
// monitor connects and one that starts later (MIGRATION event), and a
// snapshot job; the monitor is "connected" until the same process holds
// the VM's device connection, then "verified".
func TestQMPMonitorGuard(t *testing.T) {
	d, dir, _ := testDaemon(t)
	p := dialQMPPeer(t, filepath.Join(dir, "vm1.qmp"))
	p.send(`{"QMP": {"version": {"qemu": {"micro": 3, "minor": 1, "major": 11}, "package": ""}, "capabilities": []}}`)
	p.expect("qmp_capabilities", `{}`)
	p.expect("migrate-set-capabilities", `{}`)
	p.expect("query-migrate", `{"status": "active"}`)
	p.expect("migrate_cancel", `{}`)
	p.expect("query-jobs", `[{"id": "s1", "type": "snapshot-save", "status": "running"}, {"id": "b1", "type": "backup", "status": "running"}]`)
	p.expect("job-cancel", `{}`)

	p.send(`{"event": "MIGRATION", "data": {"status": "cancelled"}, "timestamp": {"seconds": 1, "microseconds": 1}}`)
	// A second migration; its "active" event was queued before the
	// cancel took effect: cancelled again, counted once.
	p.send(`{"event": "MIGRATION", "data": {"status": "setup"}, "timestamp": {"seconds": 1, "microseconds": 2}}`)
	p.expect("migrate_cancel", `{}`)
	p.send(`{"event": "MIGRATION", "data": {"status": "active"}, "timestamp": {"seconds": 1, "microseconds": 3}}`)
	p.expect("migrate_cancel", `{}`)
	p.send(`{"event": "MIGRATION", "data": {"status": "cancelled"}, "timestamp": {"seconds": 1, "microseconds": 4}}`)
	p.send(`{"event": "JOB_STATUS_CHANGE", "data": {"id": "b2", "status": "running"}, "timestamp": {"seconds": 1, "microseconds": 4}}`)
	p.expect("query-jobs", `[{"id": "b2", "type": "backup", "status": "running"}]`)

	st := vmStatus(t, d, "vm1")
	assert.Equal(t, uint64(2), st.MigrationsCancelled)
	assert.Equal(t, uint64(1), st.SnapshotsCancelled, "the backup job is left alone")
	assert.Equal(t, QMPConnected, st.QMP, "no device connection yet")
	assert.Equal(t, filepath.Join(dir, "vm1.qmp"), st.QMPSocket)

	c := dialVM(t, filepath.Join(dir, "vm1.sock")) // this process: the monitor's peer
	defer c.Close()
	require.Eventually(t, func() bool { return vmStatus(t, d, "vm1").QMP == QMPVerified }, hangBound, 10*time.Millisecond)
}

// TestQMPMonitorHostilePeers: peers that are no QEMU get the monitor
// closed, never a crash or a stuck daemon; a VM keeps at most
// qmpMaxMonitors; the socket is gone once the VM is unregistered.
func TestQMPMonitorHostilePeers(t *testing.T) {
	d, dir, _ := testDaemon(t)
	path := filepath.Join(dir, "vm1.qmp")
	closed := func(p *qmpPeer) bool {
		_, _, ok := p.next()
		return !ok
	}

	p := dialQMPPeer(t, path)
	p.send(`{"hello": "not QMP"}`)
	assert.True(t, closed(p), "a bad greeting ends the monitor")

	p = dialQMPPeer(t, path)
	p.send(`{"QMP": {"version": {}, "capabilities": []}}`)
	execute, _, _ := p.next()
	require.Equal(t, "qmp_capabilities", execute)
	p.send(`{"error": {"class": "GenericError", "desc": "no"}}`)
	assert.True(t, closed(p), "a refused negotiation ends the monitor")

	p = dialQMPPeer(t, path)
	p.handshake()
	_, err := p.c.Write([]byte(`{"event": "` + strings.Repeat("A", qmpMaxLine+16)))
	require.NoError(t, err)
	assert.True(t, closed(p), "an over-long line ends the monitor")

	p = dialQMPPeer(t, path)
	p.handshake()
	p.send(`{"event": "MIGRATION", "data": {"status": 7}}`)    // wrong type: ignored
	p.send(`{"id": 999, "return": {}}`)                        // a reply nobody waits for
	p.send(`{"event": "MIGRATION", "data": {"status": "xx"}}`) // unknown status: nothing to cancel
	p.send(`[1, 2, 3]`)
	assert.True(t, closed(p), "a message that is no object ends the monitor")
	assert.Zero(t, vmStatus(t, d, "vm1").MigrationsCancelled)

	// A silent peer (no greeting) holds a place, like the others.
	peers := []*qmpPeer{dialQMPPeer(t, path)}
	for range qmpMaxMonitors - 1 {
		p := dialQMPPeer(t, path)
		p.handshake()
		peers = append(peers, p)
	}
	extra := dialQMPPeer(t, path)
	assert.True(t, closed(extra), "past qmpMaxMonitors a monitor is refused")
	assert.Equal(t, QMPConnected, vmStatus(t, d, "vm1").QMP)

	// Unregistering the VM closes every monitor, the silent one too, at
	// once, and the socket goes.
	require.NoError(t, d.RemoveVM("vm1"))
	for _, p := range peers {
		assert.True(t, closed(p))
	}
	_, err = net.Dial("unix", path)
	assert.Error(t, err)
}
