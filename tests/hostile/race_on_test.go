//go:build race

package hostile

// raceDetector is set when the tests run under the race detector, whose
// shadow memory and per-goroutine history grow the process's RSS with
// every goroutine it has seen and are not given back.
const raceDetector = true
