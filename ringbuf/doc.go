// Package ringbuf implements the PVRDMA ring (a prod_tail/cons_head pair
// whose indices carry a wrap bit) and the two-level page directory that
// names a ring's guest pages, over guest memory. Every index, page count and
// page address read from the guest is validated before use.
package ringbuf
