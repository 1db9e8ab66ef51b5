//go:build vm

package vm_test

import (
	"bufio"
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/tests/vm"
)

// TestNetworkHostPeer: a host-side socket opened in Network.Do (as the soft RoCE
// endpoint will be) talks to a guest over the bridge, and the namespace is gone after
// Close.
func TestNetworkHostPeer(t *testing.T) {
	img := image(t)
	ctx := context.Background()
	nw, err := vm.NewNetwork(t, vm.NetworkConfig{HostAddr: "10.77.0.254/24"})
	require.NoError(t, err)
	require.FileExists(t, nw.NSPath())

	var ln net.Listener
	require.NoError(t, nw.Do(func() error {
		var err error
		ln, err = net.Listen("tcp4", "10.77.0.254:7000")
		return err
	}))
	defer ln.Close()
	// The host namespace has no such address: the socket lives in the network's.
	_, err = net.Listen("tcp4", "10.77.0.254:7001")
	require.Error(t, err)

	got := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			got <- "accept: " + err.Error()
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(time.Minute))
		line, _ := bufio.NewReader(c).ReadString('\n')
		_, _ = c.Write([]byte("pong-from-host\n"))
		got <- strings.TrimSpace(line) + " from " + c.RemoteAddr().(*net.TCPAddr).IP.String()
	}()

	g, err := vm.Start(ctx, t, img, nw, vm.Config{Name: "peer", Modules: []string{},
		NICs: []vm.NIC{{Addr: "05.0", MAC: "52:54:00:77:00:09", IP: "10.77.0.9/24"}},
		Scenario: `
ping -c 1 -W 10 10.77.0.254
(echo ping-from-guest; sleep 3) | nc -w 10 10.77.0.254 7000`})
	require.NoError(t, err)
	res, err := g.WaitOK(ctx)
	require.NoError(t, err)
	require.Contains(t, res.Output, "1 packets received")
	require.Contains(t, res.Output, "pong-from-host")
	select {
	case s := <-got:
		require.Equal(t, "ping-from-guest from 10.77.0.9", s)
	case <-time.After(10 * time.Second):
		t.Fatal("host side got nothing")
	}

	ln.Close()
	require.NoError(t, nw.Close())
	require.NoFileExists(t, nw.NSPath())
	require.Error(t, nw.Do(func() error { return nil }), "a closed network refuses Do")
}
