package vfiouser

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
)

// VERSION negotiation (vfio-user spec, "VFIO_USER_VERSION"): the client
// proposes a version and capabilities as NUL-terminated JSON
// {"capabilities": {...}}; the server answers with the same major, a minor
// no greater than proposed, and a subset of the capabilities. We speak 0.0
// (QEMU refuses anything else).
const (
	VersionMajor = 0
	VersionMinor = 0
	// maxVersionJSON bounds the capabilities text a client may send.
	maxVersionJSON = 4096
	// pageSize4K is the only DMA page size we support.
	pageSize4K = 4096
)

// Capability defaults from the spec, used when the client omits one.
const (
	defaultMaxMsgFDs   = 1
	defaultMaxDataXfer = 1 << 20
	defaultMaxDMAMaps  = 65535
)

// peerCaps are the client's capabilities, after validation.
type peerCaps struct {
	maxMsgFDs     uint64
	maxDataXfer   uint64
	maxDMAMaps    uint64
	pgsizes       uint64
	writeMultiple bool
}

// versionJSON is the JSON of a VERSION payload. Unknown members are
// ignored, as the spec's forward compatibility asks.
type versionJSON struct {
	Capabilities *struct {
		MaxMsgFDs       *uint64          `json:"max_msg_fds"`
		MaxDataXferSize *uint64          `json:"max_data_xfer_size"`
		MaxDMAMaps      *uint64          `json:"max_dma_maps"`
		PgSizes         *uint64          `json:"pgsizes"`
		WriteMultiple   *bool            `json:"write_multiple"`
		Migration       *json.RawMessage `json:"migration"`
		TwinSocket      *struct {
			Supported *bool `json:"supported"`
		} `json:"twin_socket"`
	} `json:"capabilities"`
}

// parseVersionData validates the client's capability text: NUL-terminated,
// bounded, a JSON object, with numbers where numbers belong.
func parseVersionData(data []byte) (peerCaps, error) {
	pc := peerCaps{maxMsgFDs: defaultMaxMsgFDs, maxDataXfer: defaultMaxDataXfer,
		maxDMAMaps: defaultMaxDMAMaps, pgsizes: pageSize4K}
	if len(data) == 0 {
		return pc, nil
	}
	if len(data) > maxVersionJSON {
		return pc, fmt.Errorf("capabilities of %d bytes (max %d): %w", len(data), maxVersionJSON, ErrInvalid)
	}
	if data[len(data)-1] != 0 {
		return pc, fmt.Errorf("capabilities not NUL-terminated: %w", ErrInvalid)
	}
	text := data[:len(data)-1]
	if bytes.IndexByte(text, 0) >= 0 {
		return pc, fmt.Errorf("NUL inside capabilities: %w", ErrInvalid)
	}
	if len(bytes.TrimSpace(text)) == 0 {
		return pc, nil
	}
	var v versionJSON
	dec := json.NewDecoder(bytes.NewReader(text))
	if err := dec.Decode(&v); err != nil {
		return pc, fmt.Errorf("capabilities JSON: %v: %w", err, ErrInvalid)
	}
	if dec.More() {
		return pc, fmt.Errorf("trailing data after capabilities JSON: %w", ErrInvalid)
	}
	c := v.Capabilities
	if c == nil {
		return pc, nil
	}
	if c.MaxMsgFDs != nil {
		pc.maxMsgFDs = *c.MaxMsgFDs
	}
	if c.MaxDataXferSize != nil {
		if *c.MaxDataXferSize == 0 {
			return pc, fmt.Errorf("max_data_xfer_size 0: %w", ErrInvalid)
		}
		pc.maxDataXfer = *c.MaxDataXferSize
	}
	if c.MaxDMAMaps != nil {
		pc.maxDMAMaps = *c.MaxDMAMaps
	}
	if c.PgSizes != nil {
		if *c.PgSizes&pageSize4K == 0 {
			return pc, fmt.Errorf("pgsizes %#x without 4 KiB pages: %w", *c.PgSizes, ErrUnsupported)
		}
		pc.pgsizes = *c.PgSizes
	}
	if c.WriteMultiple != nil {
		pc.writeMultiple = *c.WriteMultiple
	}
	return pc, nil
}

// handleVersion negotiates. A major version other than ours is answered
// with an error and ends the connection, as the spec requires.
func (c *conn) handleVersion(m *ownedMsg) (int, error) {
	major := le.Uint16(m.body[0:])
	minor := le.Uint16(m.body[2:])
	if major != VersionMajor {
		return 0, fatalError{fmt.Errorf("client protocol %d.%d, we speak %d.%d: %w", major, minor, VersionMajor, VersionMinor, ErrUnsupported)}
	}
	pc, err := parseVersionData(m.body[4:])
	if err != nil {
		return 0, err
	}
	c.peer = pc
	c.negotiated = true
	c.keepSaved()

	// Our capabilities, a subset of what the client proposed (write_multiple
	// only if it offered it). QEMU rejects max_msg_fds above 16, a
	// max_data_xfer_size above 64 MiB and max_dma_maps above 65535.
	js := make([]byte, 0, 192)
	js = append(js, `{"capabilities":{"max_msg_fds":`...)
	js = strconv.AppendInt(js, int64(c.cfg.MaxMsgFDs), 10)
	js = append(js, `,"max_data_xfer_size":`...)
	js = strconv.AppendUint(js, uint64(c.cfg.MaxDataXfer), 10)
	js = append(js, `,"max_dma_maps":`...)
	js = strconv.AppendInt(js, int64(c.cfg.MaxDMAMaps), 10)
	js = append(js, `,"pgsizes":`...)
	js = strconv.AppendInt(js, pageSize4K, 10)
	if pc.writeMultiple {
		js = append(js, `,"write_multiple":true`...)
	}
	js = append(js, "}}\x00"...)

	p := c.payload(4 + len(js))
	le.PutUint16(p[0:], VersionMajor)
	le.PutUint16(p[2:], min(minor, VersionMinor))
	copy(p[4:], js)
	c.log.Info("vfio-user client negotiated", "client_version", fmt.Sprintf("%d.%d", major, minor),
		"client_max_msg_fds", pc.maxMsgFDs, "client_max_data_xfer", pc.maxDataXfer,
		"client_max_dma_maps", pc.maxDMAMaps, "write_multiple", pc.writeMultiple)
	return len(p), nil
}
