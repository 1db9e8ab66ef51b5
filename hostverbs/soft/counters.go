package soft

import (
	"errors"
	"sync/atomic"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft/roce"
)

// counter names one statistic. Every reason a packet is dropped has its
// own counter.
type counter int

const (
	cntRxPackets counter = iota
	cntRxBytes
	cntTxPackets
	cntTxBytes
	cntLocalPackets
	cntDropTruncated
	cntDropIPHeader
	cntDropNotRoCE
	cntDropOpcode
	cntDropPadding
	cntDropICRC
	cntDropUnknownGID
	cntDropWrongMAC
	cntDropRoCEVersion
	cntDropUnknownQPN
	cntDropQPState
	cntDropTransport
	cntDropPKey
	cntDropQKey
	cntDropAddress
	cntDropUDNoRecv
	cntDropUDLength
	cntDropResponse
	cntDropDupRead
	cntDropSourceFault
	cntDropReplayLimited
	cntDropHandedOver
	cntDropSRQHandedOver
	cntRxHeldBehindRead
	cntRxDupRequest
	cntRxOutOfSeq
	cntTxNAKSeq
	cntTxNAKInvalid
	cntTxNAKAccess
	cntTxNAKOperation
	cntTxRNRNAK
	cntRxRNRNAK
	cntRxNAKSeq
	cntRxNAKError
	cntRetransmitTimeout
	cntRetransmitPackets
	cntRetryExceeded
	cntRNRRetryExceeded
	cntTxDropOversize
	cntTxErrors
	cntCompletions
	cntRxECNCE
	cntTxCNP
	cntRxCNP
	cntRxCNPUnsolicited
	cntRxCNPCoalesced
	cntAsyncEvents
	cntRemoteInvalidations
	cntRemoteInvalidateRefused
	cntRKeyRejected
	numCounters
)

var counterNames = [numCounters]string{
	cntRxPackets:               "rx_packets",
	cntRxBytes:                 "rx_bytes",
	cntTxPackets:               "tx_packets",
	cntTxBytes:                 "tx_bytes",
	cntLocalPackets:            "local_packets",
	cntDropTruncated:           "drop_truncated",
	cntDropIPHeader:            "drop_ip_header",
	cntDropNotRoCE:             "drop_not_roce",
	cntDropOpcode:              "drop_unsupported_opcode",
	cntDropPadding:             "drop_bad_padding",
	cntDropICRC:                "drop_bad_icrc",
	cntDropUnknownGID:          "drop_unknown_gid",
	cntDropWrongMAC:            "drop_wrong_mac",
	cntDropRoCEVersion:         "drop_roce_version_mismatch",
	cntDropUnknownQPN:          "drop_unknown_qpn",
	cntDropQPState:             "drop_qp_state",
	cntDropTransport:           "drop_wrong_transport",
	cntDropPKey:                "drop_bad_pkey",
	cntDropQKey:                "drop_bad_qkey",
	cntDropAddress:             "drop_bad_address",
	cntDropUDNoRecv:            "drop_ud_no_recv_wqe",
	cntDropUDLength:            "drop_ud_length",
	cntDropResponse:            "drop_unexpected_response",
	cntDropDupRead:             "drop_duplicate_unknown_read_atomic",
	cntDropSourceFault:         "drop_source_unreadable",
	cntDropReplayLimited:       "drop_duplicate_read_limited",
	cntDropHandedOver:          "drop_qp_handed_over",  // its QP's transport state was saved for another process (SaveTransport)
	cntDropSRQHandedOver:       "drop_srq_handed_over", // it needs a receive of an SRQ whose receives were saved for another process (SaveRecvs)
	cntRxHeldBehindRead:        "rx_held_behind_read",
	cntRxDupRequest:            "rx_duplicate_requests",
	cntRxOutOfSeq:              "rx_out_of_sequence",
	cntTxNAKSeq:                "tx_nak_psn_sequence",
	cntTxNAKInvalid:            "tx_nak_invalid_request",
	cntTxNAKAccess:             "tx_nak_remote_access",
	cntTxNAKOperation:          "tx_nak_remote_operation",
	cntTxRNRNAK:                "tx_rnr_nak",
	cntRxRNRNAK:                "rx_rnr_nak",
	cntRxNAKSeq:                "rx_nak_psn_sequence",
	cntRxNAKError:              "rx_nak_error",
	cntRetransmitTimeout:       "retransmit_timeouts",
	cntRetransmitPackets:       "retransmitted_packets",
	cntRetryExceeded:           "retry_exceeded",
	cntRNRRetryExceeded:        "rnr_retry_exceeded",
	cntTxDropOversize:          "tx_drop_oversize",
	cntTxErrors:                "tx_errors",
	cntCompletions:             "completions",
	cntRxECNCE:                 "rx_ecn_ce_marked",
	cntTxCNP:                   "tx_cnp",
	cntRxCNP:                   "rx_cnp",
	cntRemoteInvalidations:     "remote_invalidations",      // SEND with invalidate freed a fast-reg MR
	cntRemoteInvalidateRefused: "remote_invalidate_refused", // SEND with invalidate named no fast-reg MR of the QP's PD, or not its current key
	cntRKeyRejected:            "rkey_rejected",             // a WRITE, READ or atomic named an rkey that resolves to nothing here, or lacks the access or range
	cntRxCNPUnsolicited:        "rx_cnp_unsolicited",        // its QP has no ECN-capable traffic in flight or within CNPWindow: dropped
	cntRxCNPCoalesced:          "rx_cnp_coalesced",          // within RateReductionPeriod after a cut: no cut
	cntAsyncEvents:             "async_events",
}

// counters is a set of statistics, updated without locks.
type counters [numCounters]atomic.Uint64

func (c *counters) inc(n counter)           { c[n].Add(1) }
func (c *counters) add(n counter, v uint64) { c[n].Add(v) }
func (c *counters) addTo(m map[string]uint64) {
	for i := range c {
		m[counterNames[i]] += c[i].Load()
	}
}

// parseDropCounter maps a roce.Parse error to its drop counter.
func parseDropCounter(err error) counter {
	switch {
	case errors.Is(err, roce.ErrTruncated):
		return cntDropTruncated
	case errors.Is(err, roce.ErrIPVersion), errors.Is(err, roce.ErrIPHeader),
		errors.Is(err, roce.ErrFragment), errors.Is(err, roce.ErrGRH):
		return cntDropIPHeader
	case errors.Is(err, roce.ErrOpcode), errors.Is(err, roce.ErrTVer):
		return cntDropOpcode
	case errors.Is(err, roce.ErrPadding), errors.Is(err, roce.ErrNoPayload):
		return cntDropPadding
	}
	return cntDropNotRoCE
}
