package backend

import (
	"net"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzParseARP: any bytes from the fabric parse without a panic, and a
// packet arpPacket builds reads back as written.
func FuzzParseARP(f *testing.F) {
	mac := net.HardwareAddr{2, 0, 0, 0, 0, 1}
	f.Add(arpPacket(1, mac, netip.IPv4Unspecified(), netip.MustParseAddr("10.80.0.254")))
	f.Add(arpPacket(2, mac, netip.MustParseAddr("10.80.0.254"), netip.MustParseAddr("10.80.0.1")))
	f.Add([]byte{0, 1, 8, 0, 6, 4})
	f.Fuzz(func(t *testing.T, b []byte) {
		op, sha, spa, ok := parseARP(b)
		if !ok {
			return
		}
		require.Len(t, sha, 6)
		again := arpPacket(op, sha, spa, netip.AddrFrom4([4]byte(b[24:28])))
		require.Equal(t, b[:8], again[:8])
		require.Equal(t, b[8:18], again[8:18])
		require.Equal(t, b[24:28], again[24:28])
	})
}
