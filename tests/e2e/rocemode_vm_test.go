//go:build vm

package e2e

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// roceModeGuest is one VM of TestRoCEModeTable: its RoCE mode, address,
// the rows it serves (servers first, then a failing-row listener that it
// announces by adding a sync address), and the rows it runs as a client.
type roceModeGuest struct {
	name, mode, ip string
	serveOK        string // row whose servers it runs to completion ("" none)
	serveRefused   string // row whose servers it runs until they time out, announced on syncIP
	syncIP         string
	clientOK       string // row, server address
	clientOKPeer   string
	clientRefused  string
	refusedPeer    string
	refusedSync    string // the address that says the refused row's server listens
}

// refusedWait is how long (s) a refused row's client tries; refusedListen
// how long its listener waits, from before the client starts until after
// it has given up (the client waits up to 400 pings for the listener's
// announcement).
const (
	refusedWait   = 12
	refusedListen = 30
)

// roceModeScenario writes the guest's script. Each section is "=== name",
// the tool's output and "rc=N".
func roceModeScenario(g roceModeGuest) string {
	var b strings.Builder
	self := strings.Split(g.ip, "/")[0]
	fmt.Fprintf(&b, "dev=vmw_pvrdma0\nself=%s\n", self)
	b.WriteString("nic=$(ip -o -4 addr show | awk -v a=\"$self\" 'index($4, a\"/\") == 1 {print $2}')\n")
	// The configfs procedure of the RHEL guide: the device's default mode
	// is its one mode; the other is refused.
	b.WriteString(`echo '=== configfs'
grep -q ' /sys/kernel/config ' /proc/mounts || mount -t configfs configfs /sys/kernel/config
cfs=/sys/kernel/config/rdma_cm/$dev
mkdir $cfs
echo "default_roce_mode: $(cat $cfs/ports/1/default_roce_mode)"
echo "gid type 0: $(cat /sys/class/infiniband/$dev/ports/1/gid_attrs/types/0)"
for m in "IB/RoCE v1" "RoCE v2"; do
	if echo "$m" > $cfs/ports/1/default_roce_mode 2>/dev/null; then echo "set '$m': accepted"; else echo "set '$m': refused"; fi
done
rmdir $cfs
echo rc=0
`)
	step := func(name, cmd string) {
		fmt.Fprintf(&b, "echo '=== %s'\nif %s; then echo rc=0; else echo rc=$?; fi\n", name, cmd)
	}
	if g.serveOK != "" {
		step(g.serveOK+"_rping", "timeout 150 rping -s -a $self -C 10 -v")
		step(g.serveOK+"_ucmatose", "timeout 150 ucmatose -b $self")
	}
	if g.clientOK != "" {
		// The server's guest may still be booting: address resolution
		// (ARP) would time out, which rping does not retry.
		fmt.Fprintf(&b, "t=0; until ping -c 1 -W 1 %s >/dev/null 2>&1 || [ $t -ge 300 ]; do t=$((t+1)); done\n", g.clientOKPeer)
		step(g.clientOK+"_rping", "pvt_retry 90 timeout 150 rping -c -a "+g.clientOKPeer+" -C 10 -v")
		step(g.clientOK+"_ucmatose", "pvt_retry 90 timeout 150 ucmatose -s "+g.clientOKPeer)
	}
	// Both tools of a row at once. A refused connection would take the
	// CM's full retry budget (15 REQs about 4 s apart, a minute or more)
	// before the tool gives up, and neither tool nor the guest's configfs
	// can shorten it: the client is stopped after refusedWait instead. An
	// allowed connection takes about a second here (a few on a loaded
	// machine), so a client that has not connected by then never will; the daemon's
	// drop_roce_version_mismatch counter shows why.
	both := func(rping, ucmatose string) {
		fmt.Fprintf(&b, "(%s >/tmp/r 2>&1; echo rc=$? >>/tmp/r) &\n", rping)
		fmt.Fprintf(&b, "(%s >/tmp/u 2>&1; echo rc=$? >>/tmp/u) &\n", ucmatose)
	}
	if g.serveRefused != "" {
		both(fmt.Sprintf("timeout %d rping -s -a $self -C 10 -v", refusedListen), fmt.Sprintf("timeout %d ucmatose -b $self", refusedListen))
		fmt.Fprintf(&b, "sleep 2\nip addr add %s dev $nic\nwait\n", g.syncIP)
		fmt.Fprintf(&b, "echo '=== %s_rping_server'\ncat /tmp/r\necho '=== %s_ucmatose_server'\ncat /tmp/u\n", g.serveRefused, g.serveRefused)
	}
	if g.clientRefused != "" {
		fmt.Fprintf(&b, "t=0; until ping -c 1 -W 1 %s >/dev/null 2>&1 || [ $t -ge 400 ]; do t=$((t+1)); done\n", g.refusedSync)
		both(fmt.Sprintf("timeout %d rping -c -a %s -C 10 -v", refusedWait, g.refusedPeer), fmt.Sprintf("timeout %d ucmatose -s %s", refusedWait, g.refusedPeer))
		fmt.Fprintf(&b, "wait\necho '=== %s_rping'\ncat /tmp/r\necho '=== %s_ucmatose'\ncat /tmp/u\n", g.clientRefused, g.clientRefused)
	}
	b.WriteString("echo '=== end'\n")
	return b.String()
}

// TestRoCEModeTable: Red Hat's RoCE compatibility table, as far as
// one-type devices show it, with rping and ucmatose between VMs of one
// daemon. Four VMs: r1a and r1b are RoCE v1 devices, r2a and r2b RoCE v2.
//
//   - v1 client to v1 server (r1b -> r1a): connects;
//   - v2 client to v2 server (r2b -> r2a): connects;
//   - v2 client to v1 server (r2b -> r1a), the guide's failing row: no
//     connection; the daemon drops the v2 packets at the v1 device and
//     counts them;
//   - v1 client to v2 server (r1b -> r2a): the guide's dual-mode server
//     accepts it, a v2-only device cannot: no connection here either.
//
// Each guest also runs the guide's configfs procedure: default_roce_mode
// shows the device's one mode and the other is refused.
func TestRoCEModeTable(t *testing.T) {
	// Most of its minute is spent waiting for the refused rows: it runs
	// beside TestRelayOverRxe (each test has its own network namespace,
	// bridge, taps and daemon).
	t.Parallel()
	img := image(t)
	d := daemon(t, backend.Config{VMs: []backend.VMRequest{
		{Name: "r1a", RoCEMode: "v1"}, {Name: "r1b", RoCEMode: "v1"},
		{Name: "r2a", RoCEMode: "v2"}, {Name: "r2b"},
	}})
	ctx := context.Background()
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{})
	require.NoError(t, err)
	guests := []roceModeGuest{
		{name: "r1a", mode: "v1", ip: "10.78.0.1/24", serveOK: "v1v1", serveRefused: "v2v1", syncIP: "10.78.0.101/24"},
		{name: "r1b", mode: "v1", ip: "10.78.0.2/24", clientOK: "v1v1", clientOKPeer: "10.78.0.1",
			clientRefused: "v1v2", refusedPeer: "10.78.0.3", refusedSync: "10.78.0.103"},
		{name: "r2a", mode: "v2", ip: "10.78.0.3/24", serveOK: "v2v2", serveRefused: "v1v2", syncIP: "10.78.0.103/24"},
		{name: "r2b", mode: "v2", ip: "10.78.0.4/24", clientOK: "v2v2", clientOKPeer: "10.78.0.3",
			clientRefused: "v2v1", refusedPeer: "10.78.0.1", refusedSync: "10.78.0.101"},
	}
	var cfgs []vm.Config
	for _, g := range guests {
		c := pvrdmaGuest(d, g.name, g.ip, roceModeScenario(g))
		c.Modules = rdmaCMModules
		cfgs = append(cfgs, c)
	}
	res := runGuests(ctx, t, img, nw, 15*time.Minute, cfgs...)

	rcRE := regexp.MustCompile(`(?m)^rc=(\d+)$`)
	rc := func(out, sec string) string {
		m := rcRE.FindAllStringSubmatch(vm.Section(out, sec), -1)
		if len(m) == 0 {
			return "none"
		}
		return m[len(m)-1][1]
	}
	for i, r := range res {
		g := guests[i]
		require.Contains(t, r.Output, "=== end", "%s did not finish", r.VM)
		cfs := vm.Section(r.Output, "configfs")
		t.Logf("%s (RoCE %s) configfs:\n%s", g.name, g.mode, cfs)
		if g.mode == "v1" {
			assert.Contains(t, cfs, "default_roce_mode: IB/RoCE v1", g.name)
			assert.Contains(t, cfs, "gid type 0: IB/RoCE v1", g.name)
			assert.Contains(t, cfs, "set 'IB/RoCE v1': accepted", g.name)
			assert.Contains(t, cfs, "set 'RoCE v2': refused", g.name)
		} else {
			assert.Contains(t, cfs, "default_roce_mode: RoCE v2", g.name)
			assert.Contains(t, cfs, "gid type 0: RoCE v2", g.name)
			assert.Contains(t, cfs, "set 'IB/RoCE v1': refused", g.name)
			assert.Contains(t, cfs, "set 'RoCE v2': accepted", g.name)
		}
		for _, row := range []string{g.serveOK, g.clientOK} {
			for _, tool := range []string{"rping", "ucmatose"} {
				if row == "" {
					continue
				}
				sec := row + "_" + tool
				assert.Equal(t, "0", rc(r.Output, sec), "%s %s (connects):\n%s", g.name, sec, vm.Section(r.Output, sec))
			}
		}
		if g.serveRefused != "" {
			for _, tool := range []string{"rping", "ucmatose"} {
				sec := g.serveRefused + "_" + tool + "_server"
				// The listener saw no connection: it ran until its timeout
				// killed it (busybox timeout: 128 + SIGTERM), after the
				// client had given up.
				assert.Equal(t, "143", rc(r.Output, sec), "%s %s:\n%s", g.name, sec, vm.Section(r.Output, sec))
			}
		}
		if g.clientRefused != "" {
			for _, tool := range []string{"rping", "ucmatose"} {
				sec := g.clientRefused + "_" + tool
				out := vm.Section(r.Output, sec)
				assert.NotEqual(t, "0", rc(r.Output, sec), "%s %s connected:\n%s", g.name, sec, out)
				assert.NotEqual(t, "none", rc(r.Output, sec), "%s %s did not run:\n%s", g.name, sec, out)
				t.Logf("%s %s (refused row):\n%s", g.name, sec, out)
			}
		}
	}
	st := d.Status()
	t.Logf("daemon counters: drop_roce_version_mismatch=%d", st.Counters["drop_roce_version_mismatch"])
	assert.Positive(t, st.Counters["drop_roce_version_mismatch"], "the cross-version CM MADs were dropped and counted")
	for _, v := range st.VMs {
		assert.Equal(t, map[bool]string{true: "v1", false: "v2"}[strings.HasPrefix(v.Name, "r1")], v.RoCEMode, v.Name)
	}
}
