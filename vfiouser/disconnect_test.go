package vfiouser_test

import (
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pvrdma-backend/pvrdma-backend/pcidev/testdev"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser"
	"github.com/pvrdma-backend/pvrdma-backend/vfiouser/vfiousertest"
)

// TestClosedMidMessageEndsAtOnce: a client of a kept connection (read one
// whole message at a time, by peeking) sends part of a message and closes
// its end. The connection ends with io.ErrUnexpectedEOF as soon as the
// hang-up is seen, whatever part of the message came (7 bytes of a header,
// or a header and part of its body), and the server then serves the next
// connection's VERSION handshake. The wait for the rest of a partial
// header is an hour here, so only noticing the hang-up can end the first
// connection before the test's hang guard.
func TestClosedMidMessageEndsAtOnce(t *testing.T) {
	for _, tc := range []struct {
		name string
		sent func() []byte
	}{
		{"partial-header", func() []byte {
			b := make([]byte, vfiouser.HeaderSize)
			vfiouser.Header{ID: 9, Command: vfiouser.CmdDeviceGetInfo, Size: vfiouser.HeaderSize + vfiouser.DeviceInfoSize}.Encode(b)
			return b[:7]
		}},
		{"partial-body", func() []byte {
			b := make([]byte, vfiouser.HeaderSize+vfiouser.DeviceInfoSize)
			vfiouser.Header{ID: 9, Command: vfiouser.CmdDeviceGetInfo, Size: uint32(len(b))}.Encode(b)
			return b[:vfiouser.HeaderSize+3]
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := newMemKeeper()
			devs := make(chan *testdev.Device, 4)
			resumed := make(chan bool, 4)
			srv, err := vfiouser.NewServer(vfiouser.Config{NewDevice: keptFactory(k, devs, resumed), Logger: testLogger(t),
				PartialHeaderWait: time.Hour})
			require.NoError(t, err)
			t.Cleanup(func() { _ = srv.Close() })

			s, cl, err := vfiousertest.Socketpair()
			require.NoError(t, err)
			done := make(chan error, 1)
			go func() { done <- srv.ServeConn(s, "first") }()
			c := vfiousertest.NewClient(cl)
			_, err = c.Negotiate(vfiousertest.QEMUCaps)
			require.NoError(t, err)
			require.False(t, <-resumed)
			<-devs
			require.NoError(t, c.SendRaw(tc.sent()))
			require.NoError(t, c.Close())
			select {
			case err := <-done:
				require.ErrorIs(t, err, io.ErrUnexpectedEOF)
			case <-time.After(time.Minute): // a hang guard, far below the hour
				t.Fatal("the connection outlived its client")
			}

			s2, cl2, err := vfiousertest.Socketpair()
			require.NoError(t, err)
			done2 := make(chan error, 1)
			go func() { done2 <- srv.ServeConn(s2, "second") }()
			c2 := vfiousertest.NewClient(cl2)
			_, err = c2.Negotiate(vfiousertest.QEMUCaps)
			require.NoError(t, err, "the next connection is served")
			require.False(t, <-resumed)
			<-devs
			require.NoError(t, c2.Close())
			require.NoError(t, <-done2)
		})
	}
}
