//go:build guardslow

package vdev

import "time"

// guardSlowDoorbell is what a build with the tag guardslow adds to every QP
// and SRQ doorbell (a posted send or receive), while it holds the device:
// a deliberately slowed daemon, the candidate of `scripts/bench-guard
// --slow-candidate`, which the guard must flag (docs/DEVELOPING.md). No
// other build has it.
const guardSlowDoorbell = 200 * time.Microsecond

// guardSlow waits guardSlowDoorbell.
func guardSlow() { time.Sleep(guardSlowDoorbell) }
