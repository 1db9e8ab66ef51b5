//go:build !guardslow

package vdev

// guardSlow does nothing: only a build with the tag guardslow slows
// doorbells (guardslow.go).
func guardSlow() {}
