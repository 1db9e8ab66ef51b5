// Package soft is a software RoCE v2 transport implementing
// hostverbs.Provider: InfiniBand RC and UD transport (requester, responder
// and completer per QP, as in Linux rxe) carried in UDP port 4791, wire
// compatible with Linux Soft-RoCE and RoCE HCAs.
package soft
