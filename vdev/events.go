package vdev

import (
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

const eventPortActive = hostverbs.EventPortActive

// HandleEvent delivers a provider async event to the guest's event ring
// (vector 1). Wire it to hostverbs.DeviceConfig.Events. QP events name the
// QP's handle (stale QPs are dropped), CQ and SRQ events the handle the
// object was created with, port events port 1. Safe from any goroutine.
func (d *Device) HandleEvent(ev hostverbs.AsyncEvent) {
	switch ev.Type {
	case hostverbs.EventQPFatal, hostverbs.EventQPReqErr, hostverbs.EventQPAccessErr,
		hostverbs.EventCommEst, hostverbs.EventSQDrained, hostverbs.EventPathMig,
		hostverbs.EventPathMigErr, hostverbs.EventQPLastWQEReach:
		q := d.liveQP(ev.Context)
		if q == nil {
			d.stats.asyncDropped.Add(1)
			return
		}
		switch ev.Type {
		case hostverbs.EventQPFatal, hostverbs.EventQPReqErr, hostverbs.EventQPAccessErr:
			q.state.Store(uint32(hostverbs.QPStateErr))
		}
		d.pushEvent(uint32(ev.Type), q.handle)
	case hostverbs.EventCQErr, hostverbs.EventSRQErr, hostverbs.EventSRQLimitReached:
		if ev.Context > abi.UARHandleMask {
			d.stats.asyncDropped.Add(1)
			return
		}
		d.pushEvent(uint32(ev.Type), uint32(ev.Context))
	case hostverbs.EventPortActive, hostverbs.EventPortErr, hostverbs.EventLIDChange,
		hostverbs.EventPKeyChange, hostverbs.EventSMChange, hostverbs.EventClientRereg,
		hostverbs.EventGIDChange, hostverbs.EventDeviceFatal:
		d.pushEvent(uint32(ev.Type), portNum)
	default:
		d.stats.asyncDropped.Add(1)
	}
}
