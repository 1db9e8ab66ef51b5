package vdev

// Objects counts the device's live objects by kind ("uc", "pd", "mr", "cq",
// "qp", "srq"), the bytes of registered memory ("mr_bytes") and what the
// objects cost the daemon ("object_bytes", Limits.MaxBytes), for the
// daemon's status and metrics.
func (d *Device) Objects() map[string]int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return map[string]int{
		"uc": d.ucs.len(), "pd": d.pds.len(), "mr": d.mrs.len(),
		"cq": d.cqs.len(), "qp": d.qps.len(), "srq": d.srqs.len(),
		"mr_bytes":     int(d.mrBytes),
		"object_bytes": int(d.heap.Used()),
	}
}

// InterruptPending reports whether ICR holds an unread cause: the level of
// the device's INTx line when the guest runs without MSI-X.
func (d *Device) InterruptPending() bool { return d.icr.Load() != 0 }
