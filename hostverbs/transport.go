package hostverbs

// SendDrainer is implemented by provider QPs that can tell when their send
// side is idle, for a daemon that waits for it before handing its VMs over
// to another process (an upgrade under running guests).
type SendDrainer interface {
	// SendsDrained reports whether the QP holds no send work: every send
	// work request posted to it has completed and its completion has been
	// delivered to the CQ's handler (the call returned), and nothing it
	// owes its peer is still queued (RDMA READ responses, for RC).
	// Receive work requests may stay posted. It is safe to call
	// concurrently with traffic; the answer may be stale as soon as it is
	// given unless the caller stops posting.
	SendsDrained() bool
}

// TransportSaver is implemented by provider QPs whose transport state (the
// sequence numbers and replay resources an RC connection runs on) can be
// saved by one process and restored by another into a QP with the same
// QPN, so that the connection goes on with its peer where it was: the
// peer sees at most packet loss, which the transport recovers from.
//
// The sequence is: the QP's sends drain (SendsDrained), SaveTransport
// freezes the QP and returns its state; the new process creates a QP with
// the same QPN (QPInitAttr.QPN), replays the MODIFY_QPs that brought the
// old one to its state, calls RestoreTransport before posting any send,
// then posts the receives and sends the old QP had not completed. The
// memory regions the peer uses must be registered again with the same
// keys (a duplicate READ is answered from them).
type TransportSaver interface {
	SendDrainer
	// SaveTransport returns the QP's transport state as a versioned,
	// self-describing blob and freezes the QP: from then on it drops the
	// packets it receives (as if lost on the wire; the peer retransmits
	// them to the QP the state is restored into) and sends nothing new,
	// so that the state returned stays the QP's. It succeeds only when the
	// QP is quiescent: connected (RTR, RTS or SQD), no send work in flight
	// or queued, no RDMA READ responses pending, no message partly
	// received; otherwise it fails with an error wrapping ErrBusy and the
	// QP is not frozen. A QP of a type without transport state (UD, GSI)
	// fails with ErrNotSupported. Saving a frozen QP again returns its
	// state again.
	SaveTransport() ([]byte, error)
	// ResumeTransport undoes SaveTransport (a hand-over abandoned): the QP
	// processes packets again and goes on as if the save had not
	// happened. Posting work to a frozen QP or modifying it resumes it
	// too. It does nothing on a QP that is not frozen.
	ResumeTransport()
	// RestoreTransport applies state, which SaveTransport returned for a
	// QP with the same QPN, type, destination QPN, state and resources
	// (max_dest_rd_atomic), to this QP, created with that QPN and brought
	// to that state by the same MODIFY_QPs, before any send is posted to
	// it (receives may be posted before or after). state is untrusted: a
	// blob of another version or length, or whose values are out of range
	// or inconsistent with each other or with the QP, fails with an error
	// wrapping ErrInvalid (ErrBusy if sends were posted or requests
	// received already, ErrNotSupported for a QP without transport state)
	// and leaves the QP untouched.
	RestoreTransport(state []byte) error
}

// SRQSaver is implemented by provider SRQs whose posted receives can be
// handed over to another process with the QPs that use them (an upgrade
// under running guests). A device model releases an SRQ's receive work
// requests to the provider when it posts them, so the receives the
// provider holds exist nowhere else: SaveRecvs returns them, and the new
// process posts them again, in the order given, to an SRQ created like
// this one, before any newer receive and before its QPs go on.
type SRQSaver interface {
	// SaveRecvs freezes the SRQ and returns the receive work requests it
	// holds that no QP has taken, in the order QPs would take them, each
	// with its WRID and SGEs as posted (the SGL is the caller's). From
	// then on no QP takes a receive from it, so the list stays exact: a
	// connected QP drops a request that needs one (as if lost on the
	// wire; the peer resends it to the next process), a UD QP drops the
	// datagram. A receive a QP took before (a message partly received)
	// stays that QP's. Saving a frozen SRQ again returns the same list.
	SaveRecvs() ([]RecvWR, error)
	// ResumeRecvs undoes SaveRecvs (a hand-over abandoned): QPs take
	// receives from the SRQ again. Posting to the SRQ or modifying it
	// resumes it too. It does nothing on an SRQ that is not frozen.
	ResumeRecvs()
}
