package roce

import (
	"encoding/binary"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSetIPv4IDMatchesReseal moves sealed packets of many sizes to other
// IDs through the table and checks the ICRC equals a full recomputation.
func TestSetIPv4IDMatchesReseal(t *testing.T) {
	var tab IPIDTable
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{0, 4, 8, 256, 1024, 1500, 4096} {
		d := buildPacket(t, "::ffff:10.0.0.1", "::ffff:10.0.0.2", opWithPayload(RCSendOnly, n), n)
		for range 50 {
			id := uint16(rng.Uint32())
			tab.SetIPv4ID(d, id)
			require.Equal(t, id, binary.BigEndian.Uint16(d[4:]))
			require.Equal(t, ICRC(d, IPv4HeaderSize), binary.LittleEndian.Uint32(d[len(d)-ICRCSize:]), "n=%d id=%#x", n, id)
			require.Equal(t, IPv4Checksum(d[:IPv4HeaderSize]), binary.BigEndian.Uint16(d[10:]))
		}
	}
}

// TestRecoverIPv4ID rebuilds headers with a wrong ID and DF and checks the
// table finds the real ones, and that corruption elsewhere is not
// explained away.
func TestRecoverIPv4ID(t *testing.T) {
	var tab IPIDTable
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{0, 64, 1024, 4096} {
		d := buildPacket(t, "::ffff:192.168.1.1", "::ffff:192.168.1.2", opWithPayload(RCWriteOnly, n), n)
		for range 100 {
			id := uint16(rng.Uint32())
			tab.SetIPv4ID(d, id)
			df := rng.IntN(2) == 0
			if !df { // a sender without DF: reseal with the flag cleared
				d[6] &^= 0x40
				SealICRC(d, IPv4HeaderSize)
			}
			// What a UDP receiver rebuilds: a guessed ID, DF set.
			rx := append([]byte(nil), d...)
			binary.BigEndian.PutUint16(rx[4:], uint16(rng.Uint32()))
			rx[6] |= 0x40
			require.True(t, tab.RecoverIPv4ID(rx))
			require.Equal(t, id, binary.BigEndian.Uint16(rx[4:]))
			require.Equal(t, df, rx[6]&0x40 != 0)
			var p Packet
			require.NoError(t, p.Parse(rx))
			require.True(t, p.ICRCValid())
			d[6] |= 0x40
			SealICRC(d, IPv4HeaderSize)
		}
	}
	// Single corrupted bytes anywhere but the ID, flags and the masked
	// fields: never explained by an ID (a burst of 8 bits and the ID's 17
	// stay within CRC-32's guarantee only together, so this is measured,
	// not proven: the seed is fixed).
	d := buildPacket(t, "::ffff:192.168.1.1", "::ffff:192.168.1.2", RCSendOnly, 1024)
	accepted := 0
	for i := IPv4HeaderSize + UDPHeaderSize; i < len(d)-ICRCSize; i++ {
		if i == IPv4HeaderSize+UDPHeaderSize+4 { // BTH byte 4 is masked
			continue
		}
		rx := append([]byte(nil), d...)
		rx[i] ^= byte(1 + rng.IntN(255))
		if tab.RecoverIPv4ID(rx) {
			accepted++
		}
	}
	require.Zero(t, accepted, "corrupted packets explained by an ID")
}

// opWithPayload is op for n payload bytes, an ACK for none.
func opWithPayload(op Opcode, n int) Opcode {
	if n == 0 {
		return RCAcknowledge
	}
	return op
}

func BenchmarkRecoverIPv4ID(b *testing.B) {
	var tab IPIDTable
	d := buildPacket(b, "::ffff:10.0.0.1", "::ffff:10.0.0.2", RCWriteOnly, 4096)
	tab.SetIPv4ID(d, 77)
	binary.BigEndian.PutUint16(d[4:], 0)
	b.SetBytes(int64(len(d)))
	for b.Loop() {
		binary.BigEndian.PutUint16(d[4:], 0)
		if !tab.RecoverIPv4ID(d) {
			b.Fatal("not recovered")
		}
	}
}

// FuzzRecoverIPv4ID feeds arbitrary IPv4 RoCE datagrams, as a UDP
// receiver rebuilds them, to RecoverIPv4ID: nothing may panic, and a
// datagram it accepts must then carry a valid ICRC and differ from the
// input only in the ID, DF and header checksum.
func FuzzRecoverIPv4ID(f *testing.F) {
	var tab IPIDTable
	for _, n := range []int{0, 8, 1024} {
		d := buildPacket(f, "::ffff:10.0.0.1", "::ffff:10.0.0.2", opWithPayload(RCWriteOnly, n), n)
		tab.SetIPv4ID(d, 0x1234)
		binary.BigEndian.PutUint16(d[4:], 0)
		f.Add(d)
	}
	f.Fuzz(func(t *testing.T, d []byte) {
		var p Packet
		if p.Parse(d) != nil || p.IPv6 {
			return
		}
		in := append([]byte(nil), d...)
		if !tab.RecoverIPv4ID(d) {
			require.Equal(t, in, d, "a refused datagram is left as it was")
			return
		}
		require.NoError(t, p.Parse(d))
		require.True(t, p.ICRCValid())
		for i := range d {
			if i != 4 && i != 5 && i != 6 && i != 10 && i != 11 {
				require.Equal(t, in[i], d[i], "byte %d", i)
			}
		}
	})
}
