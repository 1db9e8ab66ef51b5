package vdev

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/pvrdma-backend/pvrdma-backend/guestmem"
	"github.com/pvrdma-backend/pvrdma-backend/hostverbs"
	"github.com/pvrdma-backend/pvrdma-backend/ringbuf"
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

var commands = [NumCmds]command{
	CmdQueryPort:   {"QUERY_PORT", QueryPortSize, RespFlag | CmdQueryPort, QueryPortRespSize, (*Device).cmdQueryPort},
	CmdQueryPKey:   {"QUERY_PKEY", QueryPKeySize, RespFlag | CmdQueryPKey, QueryPKeyRespSize, (*Device).cmdQueryPKey},
	CmdCreatePD:    {"CREATE_PD", CreatePDSize, RespFlag | CmdCreatePD, CreatePDRespSize, (*Device).cmdCreatePD},
	CmdDestroyPD:   {"DESTROY_PD", DestroyPDSize, RespFlag | CmdDestroyPD, RespHdrSize, (*Device).cmdDestroyPD},
	CmdCreateMR:    {"CREATE_MR", CreateMRSize, RespFlag | CmdCreateMR, CreateMRRespSize, (*Device).cmdCreateMR},
	CmdDestroyMR:   {"DESTROY_MR", DestroyMRSize, RespFlag | CmdDestroyMR, RespHdrSize, (*Device).cmdDestroyMR},
	CmdCreateCQ:    {"CREATE_CQ", CreateCQSize, RespFlag | CmdCreateCQ, CreateCQRespSize, (*Device).cmdCreateCQ},
	CmdResizeCQ:    {"RESIZE_CQ", ResizeCQSize, RespFlag | CmdResizeCQ, ResizeCQRespSize, (*Device).cmdResizeCQ},
	CmdDestroyCQ:   {"DESTROY_CQ", DestroyCQSize, RespFlag | CmdDestroyCQ, RespHdrSize, (*Device).cmdDestroyCQ},
	CmdCreateQP:    {"CREATE_QP", CreateQPSize, RespFlag | CmdCreateQP, CreateQPRespV2Size, (*Device).cmdCreateQP},
	CmdModifyQP:    {"MODIFY_QP", ModifyQPSize, RespFlag | CmdModifyQP, RespHdrSize, (*Device).cmdModifyQP},
	CmdQueryQP:     {"QUERY_QP", QueryQPSize, RespFlag | CmdQueryQP, QueryQPRespSize, (*Device).cmdQueryQP},
	CmdDestroyQP:   {"DESTROY_QP", DestroyQPSize, RespFlag | CmdDestroyQP, DestroyQPRespSize, (*Device).cmdDestroyQP},
	CmdCreateUC:    {"CREATE_UC", CreateUCSize, RespFlag | CmdCreateUC, CreateUCRespSize, (*Device).cmdCreateUC},
	CmdDestroyUC:   {"DESTROY_UC", DestroyUCSize, RespFlag | CmdDestroyUC, RespHdrSize, (*Device).cmdDestroyUC},
	CmdCreateBind:  {"CREATE_BIND", CreateBindSize, RespFlag | CmdCreateBind, RespHdrSize, (*Device).cmdCreateBind},
	CmdDestroyBind: {"DESTROY_BIND", DestroyBindSize, RespFlag | CmdDestroyBind, RespHdrSize, (*Device).cmdDestroyBind},
	CmdCreateSRQ:   {"CREATE_SRQ", CreateSRQSize, RespFlag | CmdCreateSRQ, CreateSRQRespSize, (*Device).cmdCreateSRQ},
	CmdModifySRQ:   {"MODIFY_SRQ", ModifySRQSize, RespFlag | CmdModifySRQ, RespHdrSize, (*Device).cmdModifySRQ},
	CmdQuerySRQ:    {"QUERY_SRQ", QuerySRQSize, RespFlag | CmdQuerySRQ, QuerySRQRespSize, (*Device).cmdQuerySRQ},
	CmdDestroySRQ:  {"DESTROY_SRQ", DestroySRQSize, RespFlag | CmdDestroySRQ, RespHdrSize, (*Device).cmdDestroySRQ},
}

// CommandName returns the name of command code c, or "" if unknown.
func CommandName(c uint32) string {
	if c < NumCmds {
		return commands[c].name
	}
	return ""
}

// execCommand runs the command in the command slot (a REQUEST write), as
// pvrdma_cmd_post expects: ERR holds 0 or a positive errno when REQUEST
// returns, the response (if the command has one) is in the response slot,
// and vector 0 fires. The driver reads ERR first and only waits for the
// interrupt and reads the response when ERR is 0; callers such as
// MODIFY_QP also check the response's err.
func (d *Device) execCommand() {
	d.stats.commands.Add(1)
	err := d.dispatch()
	if err != nil {
		d.stats.commandErrors.Add(1)
		d.errReg = errnoOf(err)
		d.lim.Debug("command-failed", "pvrdma: command failed", "err", err)
	} else {
		d.errReg = 0
	}
	d.raise(VectorResponse)
}

func (d *Device) dispatch() error {
	if d.dsr == nil {
		return ErrNoDSR // CVE-2022-1050: no slots to read or write yet
	}
	req := d.req[:]
	if err := d.mem.ReadAt(req, d.dsr.cmdSlot); err != nil {
		return fmt.Errorf("read command slot: %w", err)
	}
	var hdr CmdHdr
	hdr.Decode(req)
	if hdr.Cmd >= NumCmds {
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
	RespHdr{Response: hdr.Response, Ack: c.respCode, Err: uint8(errnoOf(err))}.Encode(resp)
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
