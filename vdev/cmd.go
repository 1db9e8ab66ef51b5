package vdev

import (
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
	"github.com/pvrdma-backend/pvrdma-backend/vdev/abi"
)

// command describes one PVRDMA command: how many request bytes it reads,
// which response code it acknowledges with, how many response bytes it
// writes, and its handler. The table below drives dispatch, as QEMU's
// pvrdma_cmd.c and rxe's opcode table do.
type command struct {
	name     string
	reqSize  int
	respCode uint32
	respSize int
	// run decodes req (reqSize bytes), does the work and encodes the
	// response payload into resp (respSize bytes; the header is the
	// dispatcher's).
	run func(d *Device, req, resp []byte) error
}

var commands = [abi.NumCmds]command{
	abi.CmdQueryPort:   {"QUERY_PORT", abi.QueryPortSize, abi.RespFlag | abi.CmdQueryPort, abi.QueryPortRespSize, (*Device).cmdQueryPort},
	abi.CmdQueryPKey:   {"QUERY_PKEY", abi.QueryPKeySize, abi.RespFlag | abi.CmdQueryPKey, abi.QueryPKeyRespSize, (*Device).cmdQueryPKey},
	abi.CmdCreatePD:    {"CREATE_PD", abi.CreatePDSize, abi.RespFlag | abi.CmdCreatePD, abi.CreatePDRespSize, (*Device).cmdCreatePD},
	abi.CmdDestroyPD:   {"DESTROY_PD", abi.DestroyPDSize, abi.RespFlag | abi.CmdDestroyPD, abi.RespHdrSize, (*Device).cmdDestroyPD},
	abi.CmdCreateMR:    {"CREATE_MR", abi.CreateMRSize, abi.RespFlag | abi.CmdCreateMR, abi.CreateMRRespSize, (*Device).cmdCreateMR},
	abi.CmdDestroyMR:   {"DESTROY_MR", abi.DestroyMRSize, abi.RespFlag | abi.CmdDestroyMR, abi.RespHdrSize, (*Device).cmdDestroyMR},
	abi.CmdCreateCQ:    {"CREATE_CQ", abi.CreateCQSize, abi.RespFlag | abi.CmdCreateCQ, abi.CreateCQRespSize, (*Device).cmdCreateCQ},
	abi.CmdResizeCQ:    {"RESIZE_CQ", abi.ResizeCQSize, abi.RespFlag | abi.CmdResizeCQ, abi.ResizeCQRespSize, (*Device).cmdResizeCQ},
	abi.CmdDestroyCQ:   {"DESTROY_CQ", abi.DestroyCQSize, abi.RespFlag | abi.CmdDestroyCQ, abi.RespHdrSize, (*Device).cmdDestroyCQ},
	abi.CmdCreateQP:    {"CREATE_QP", abi.CreateQPSize, abi.RespFlag | abi.CmdCreateQP, abi.CreateQPRespV2Size, (*Device).cmdCreateQP},
	abi.CmdModifyQP:    {"MODIFY_QP", abi.ModifyQPSize, abi.RespFlag | abi.CmdModifyQP, abi.RespHdrSize, (*Device).cmdModifyQP},
	abi.CmdQueryQP:     {"QUERY_QP", abi.QueryQPSize, abi.RespFlag | abi.CmdQueryQP, abi.QueryQPRespSize, (*Device).cmdQueryQP},
	abi.CmdDestroyQP:   {"DESTROY_QP", abi.DestroyQPSize, abi.RespFlag | abi.CmdDestroyQP, abi.DestroyQPRespSize, (*Device).cmdDestroyQP},
	abi.CmdCreateUC:    {"CREATE_UC", abi.CreateUCSize, abi.RespFlag | abi.CmdCreateUC, abi.CreateUCRespSize, (*Device).cmdCreateUC},
	abi.CmdDestroyUC:   {"DESTROY_UC", abi.DestroyUCSize, abi.RespFlag | abi.CmdDestroyUC, abi.RespHdrSize, (*Device).cmdDestroyUC},
	abi.CmdCreateBind:  {"CREATE_BIND", abi.CreateBindSize, abi.RespFlag | abi.CmdCreateBind, abi.RespHdrSize, (*Device).cmdCreateBind},
	abi.CmdDestroyBind: {"DESTROY_BIND", abi.DestroyBindSize, abi.RespFlag | abi.CmdDestroyBind, abi.RespHdrSize, (*Device).cmdDestroyBind},
	abi.CmdCreateSRQ:   {"CREATE_SRQ", abi.CreateSRQSize, abi.RespFlag | abi.CmdCreateSRQ, abi.CreateSRQRespSize, (*Device).cmdCreateSRQ},
	abi.CmdModifySRQ:   {"MODIFY_SRQ", abi.ModifySRQSize, abi.RespFlag | abi.CmdModifySRQ, abi.RespHdrSize, (*Device).cmdModifySRQ},
	abi.CmdQuerySRQ:    {"QUERY_SRQ", abi.QuerySRQSize, abi.RespFlag | abi.CmdQuerySRQ, abi.QuerySRQRespSize, (*Device).cmdQuerySRQ},
	abi.CmdDestroySRQ:  {"DESTROY_SRQ", abi.DestroySRQSize, abi.RespFlag | abi.CmdDestroySRQ, abi.RespHdrSize, (*Device).cmdDestroySRQ},
}

// CommandName returns the name of command code c, or "" if unknown.
func CommandName(c uint32) string {
	if c < abi.NumCmds {
		return commands[c].name
	}
	return ""
}

// execCommand runs the command in the command slot (a REQUEST write), as
// pvrdma_cmd_post expects: ERR holds 0 or a positive errno when REQUEST
// returns, the response (if the command has one) is in the response slot,
// and vector 0 fires, signalled before the write is answered (raiseSync).
// The driver reads ERR first and only waits for the interrupt and reads
// the response when ERR is 0; callers such as MODIFY_QP also check the
// response's err.
func (d *Device) execCommand() {
	d.stats.commands.Add(1)
	if d.uarm != nil && d.rp == nil {
		// Memory doorbells: what the guest stored before this command
		// is taken before it (a POLL of a CQ it destroys now names a
		// live CQ), as a trapped doorbell would have been.
		d.pollUARLocked(time.Now())
	}
	err := d.dispatch()
	if err != nil {
		d.stats.commandErrors.Add(1)
		d.errReg = errnoOf(err)
		d.lim.Debug("command-failed", "pvrdma: command failed", "err", err)
	} else {
		d.errReg = 0
	}
	d.raiseSync(abi.VectorResponse)
}

func (d *Device) dispatch() error {
	if d.dsr == nil {
		return ErrNoDSR // CVE-2022-1050: no slots to read or write yet
	}
	req := d.req[:]
	if err := d.mem.ReadAt(req, d.dsr.cmdSlot); err != nil {
		return fmt.Errorf("read command slot: %w", err)
	}
	var hdr abi.CmdHdr
	hdr.Decode(req)
	if hdr.Cmd >= abi.NumCmds {
		return fmt.Errorf("command %d: %w", hdr.Cmd, hostverbs.ErrInvalid)
	}
	c := &commands[hdr.Cmd]
	resp := d.resp[:c.respSize]
	clear(resp)
	err := c.run(d, req[:c.reqSize], resp)
	if err != nil {
		err = fmt.Errorf("%s: %w", c.name, err)
	}
	d.journalCommand(hdr.Cmd, req[:c.reqSize], resp, err)
	abi.RespHdr{Response: hdr.Response, Ack: c.respCode, Err: uint8(errnoOf(err))}.Encode(resp)
	if werr := d.mem.WriteAt(resp, d.dsr.respSlot); werr != nil && err == nil {
		err = fmt.Errorf("%s: write response slot: %w", c.name, werr)
	}
	return err
}

// errnoOf converts an error to the errno the guest sees (0 for nil).
// Provider errors keep their meaning; guest memory and ring errors are
// EFAULT and EINVAL.
func errnoOf(err error) uint32 {
	var en syscall.Errno
	switch {
	case err == nil:
		return 0
	case errors.Is(err, guestmem.ErrUnmapped), errors.Is(err, guestmem.ErrNotShared),
		errors.Is(err, guestmem.ErrReadOnly), errors.Is(err, guestmem.ErrRange):
		return uint32(syscall.EFAULT)
	case errors.Is(err, ringbuf.ErrPageCount), errors.Is(err, ringbuf.ErrPageAddr),
		errors.Is(err, ringbuf.ErrIndex), errors.Is(err, ringbuf.ErrGeometry),
		errors.Is(err, guestmem.ErrAlign):
		return uint32(syscall.EINVAL)
	case errors.As(err, &en):
		return uint32(en)
	}
	e := uint32(hostverbs.Errno(err))
	if e == 0 || e > 255 {
		e = uint32(syscall.EIO)
	}
	return e
}
