//go:build linux

package soft

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// netns is a named network namespace made for one test and removed after.
type netns struct {
	name string
	path string
}

// needRoot skips tests that need CAP_NET_ADMIN and CAP_NET_RAW.
func needRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces, raw sockets)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs iproute2")
	}
}

func newNetns(t testing.TB, tag string) *netns {
	t.Helper()
	name := fmt.Sprintf("soft%s%d", tag, os.Getpid()%100000)
	_ = exec.Command("ip", "netns", "del", name).Run()
	run(t, "ip", "netns", "add", name)
	n := &netns{name: name, path: "/var/run/netns/" + name}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	n.ip(t, "link", "set", "lo", "up")
	return n
}

func run(t testing.TB, args ...string) string {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// addAddr6 adds IPv6 address addr (with its prefix length) to dev without
// duplicate address detection, and waits until the namespace takes
// packets for it: Linux configures even a nodad address for reception in
// a work item after the netlink request returns (its local route appears
// then), and packets that come before are not delivered.
func (n *netns) addAddr6(t testing.TB, addr, dev string) {
	t.Helper()
	n.ip(t, "addr", "add", addr, "dev", dev, "nodad")
	host, _, _ := strings.Cut(addr, "/")
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(n.ip(t, "-6", "route", "show", "table", "local", host), host) {
		if time.Now().After(deadline) {
			t.Fatalf("%s on %s: no local route after 10s", addr, dev)
		}
		time.Sleep(time.Millisecond)
	}
}

func (n *netns) ip(t testing.TB, args ...string) string {
	t.Helper()
	return run(t, append([]string{"ip", "-n", n.name}, args...)...)
}

// do runs fn on a thread inside the namespace; sockets fn opens stay in it.
func (n *netns) do(t testing.TB, fn func()) {
	t.Helper()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// The thread is not unlocked: if restoring the namespace failed it
		// must die with the goroutine rather than serve other code.
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		fd, err := unix.Open(n.path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			errc <- err
			return
		}
		defer unix.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns %s: %w", n.name, err)
			return
		}
		fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("restore netns: %w", err)
			return
		}
		runtime.UnlockOSThread()
		errc <- nil
	}()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// snmp returns a counter from the namespace's /proc/net/snmp (e.g.
// "Icmp", "OutDestUnreachs").
func (n *netns) snmp(t testing.TB, group, field string) int64 {
	t.Helper()
	var v int64 = -1
	n.do(t, func() {
		b, err := os.ReadFile("/proc/thread-self/net/snmp")
		if err != nil {
			return
		}
		lines := strings.Split(string(b), "\n")
		for i := 0; i+1 < len(lines); i += 2 {
			names, vals := strings.Fields(lines[i]), strings.Fields(lines[i+1])
			if len(names) == 0 || names[0] != group+":" || len(names) != len(vals) {
				continue
			}
			for j := range names {
				if names[j] == field {
					fmt.Sscan(vals[j], &v)
				}
			}
		}
	})
	return v
}
