//go:build !amd64

package crc

const haveFold = false

func fold(r uint32, dst, src []byte, st *[16]byte) { panic("crc: no folding on this architecture") }
