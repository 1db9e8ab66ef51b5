package vm

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func readSample(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "perf", name))
	require.NoError(t, err)
	return string(b)
}

func TestParsePingPong(t *testing.T) {
	// Captured from bookworm ibv_rc_pingpong between two rxe guests.
	p, err := ParsePingPong(readSample(t, "ibv_rc_pingpong_server.txt"))
	require.NoError(t, err)
	require.Equal(t, PingPong{Bytes: 8192000, Iters: 1000, Seconds: 2.81, Mbps: 23.32, UsecPerIter: 2810.23}, p)

	_, err = ParsePingPong("  local address:  LID 0x0000\nCouldn't connect to 10.77.0.1:18515\n")
	require.True(t, errors.Is(err, ErrNoResult))
	_, err = ParsePingPong("8192000 bytes in 2.81 seconds = 23.32 Mbit/sec\n")
	require.True(t, errors.Is(err, ErrNoResult), "both lines are required")
}

func TestParsePerftestBW(t *testing.T) {
	bw, err := ParsePerftestBW(readSample(t, "ib_send_bw_client.txt"))
	require.NoError(t, err)
	require.Equal(t, []BW{{Bytes: 65536, Iterations: 200, PeakMBps: 9.74, AvgMBps: 9.11, MsgRateMpps: 0.000146}}, bw)

	bw, err = ParsePerftestBW(readSample(t, "ib_write_bw_server.txt"))
	require.NoError(t, err)
	require.Len(t, bw, 1)
	require.InDelta(t, 12.16, bw[0].AvgMBps, 1e-9)

	// --report_gbits prints Gb/sec; -a prints one row per size.
	gb := " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n" +
		" 2          1000             0.08               0.08   		   4.932518\n" +
		" 4          1000             0.16               0.16   		   4.932518\n" +
		"---------------------------------------------------------------------------------------\n"
	bw, err = ParsePerftestBW(gb)
	require.NoError(t, err)
	require.Len(t, bw, 2)
	require.InDelta(t, 10.0, bw[0].AvgMBps, 1e-9)
	require.EqualValues(t, 4, bw[1].Bytes)

	_, err = ParsePerftestBW(readSample(t, "ib_write_lat_client.txt"))
	require.True(t, errors.Is(err, ErrNoResult), "a latency table is not a bandwidth table")
	_, err = ParsePerftestBW(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n 65536 200\n")
	require.Error(t, err, "short row")
}

func TestParsePerftestLat(t *testing.T) {
	lat, err := ParsePerftestLat(readSample(t, "ib_write_lat_client.txt"))
	require.NoError(t, err)
	require.Equal(t, []Lat{{Bytes: 2, Iterations: 200, Min: 232.53, Max: 10262.98, Typical: 2928.27,
		Avg: 2642.82, Stdev: 1730.87, P99: 6650.72, P999: 10262.98}}, lat)
	_, err = ParsePerftestLat(readSample(t, "ib_send_bw_server.txt"))
	require.True(t, errors.Is(err, ErrNoResult))
}

func TestSection(t *testing.T) {
	out := "pre\n=== a\nline1\nline2\n=== b\nline3\n"
	require.Equal(t, "line1\nline2", Section(out, "a"))
	require.Equal(t, "line3\n", Section(out, "b"))
	require.Equal(t, "", Section(out, "c"))
}

func FuzzParsePerftest(f *testing.F) {
	for _, n := range []string{"ib_send_bw_client.txt", "ib_write_bw_server.txt", "ib_write_lat_client.txt", "ibv_rc_pingpong_client.txt"} {
		b, err := os.ReadFile(filepath.Join("testdata", "perf", n))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(string(b))
	}
	f.Fuzz(func(t *testing.T, s string) {
		_, _ = ParsePerftestBW(s)
		_, _ = ParsePerftestLat(s)
		_, _ = ParsePingPong(s)
		_ = Section(s, "x")
	})
}
