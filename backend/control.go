package backend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"
)

// Status is the daemon's state as the control socket reports it.
type Status struct {
	Transport string            `json:"transport"`
	SocketDir string            `json:"socket_dir"`
	Fabric    FabricStatus      `json:"fabric"`
	VMs       []VMStatus        `json:"vms"`
	Counters  map[string]uint64 `json:"counters,omitempty"`
	// Handover is the last live upgrade (nil: none since the service
	// started); KeepsState says whether a restart or upgrade keeps VMs.
	Handover   *HandoverStatus `json:"handover,omitempty"`
	KeepsState bool            `json:"keeps_state"`
	PID        int             `json:"pid"`
	// Supervisor is the daemon's own supervisor, which keeps its VMs'
	// descriptors when no service manager does (nil: none).
	Supervisor *SupervisorStatus `json:"supervisor,omitempty"`
}

// SupervisorStatus describes the supervisor `serve` runs when not run by
// a service manager (package supervise): the process that holds the VMs'
// descriptors and starts the daemon's process, its worker, again if it
// dies.
type SupervisorStatus struct {
	PID int `json:"pid"`
	// Restarts counts the workers it started after one died; LastExit
	// says how the last one ended ("killed by signal SIGKILL").
	Restarts int    `json:"restarts"`
	LastExit string `json:"last_exit,omitempty"`
}

// FabricStatus describes how the daemon's devices reach the network.
type FabricStatus struct {
	Mode   string `json:"mode"` // "local", "ip" or "l2"
	Netdev string `json:"netdev,omitempty"`
	// VLAN and PCP (L2 mode): the 802.1Q tag of the fabric's frames.
	VLAN uint16 `json:"vlan,omitempty"`
	PCP  string `json:"pcp,omitempty"`
	// RoCEMode is the RoCE version of VMs registered without their own.
	RoCEMode string `json:"roce_mode"`
	// Congestion is the soft transport's congestion control: "dcqcn" or
	// "off" (empty for the relay: the host device's own).
	Congestion string `json:"congestion,omitempty"`
	// QPRates lists the QPs DCQCN has paced (those that received a CNP).
	QPRates []QPRateStatus `json:"qp_rates,omitempty"`
	// HostDevice is the RDMA device the ibverbs relay uses.
	HostDevice *HostDeviceStatus `json:"host_device,omitempty"`
}

// QPRateStatus is one QP's DCQCN state.
type QPRateStatus struct {
	VM         string  `json:"vm"`
	QPN        uint32  `json:"qpn"`
	RateMbps   float64 `json:"rate_mbps"`
	TargetMbps float64 `json:"target_mbps"`
	Alpha      float64 `json:"alpha"`
	CNPs       uint64  `json:"cnps"`
}

// HostDeviceStatus describes the relay's host RDMA device.
type HostDeviceStatus struct {
	Name string `json:"name"`
	Port uint8  `json:"port"`
	// State is the port state (ACTIVE, DOWN, ...); Error says why it is
	// unknown.
	State string `json:"state,omitempty"`
	Error string `json:"error,omitempty"`
	// GIDs is the port's GID table ("index gid type").
	GIDs []string `json:"gids,omitempty"`
	// CreatedRXE: the daemon created this rxe link and removes it at shutdown.
	CreatedRXE bool `json:"created_rxe,omitempty"`
}

// VMStatus is one VM's session.
type VMStatus struct {
	Name        string         `json:"name"`
	Socket      string         `json:"socket"`
	MAC         string         `json:"mac"`
	Connected   bool           `json:"connected"`
	Since       time.Time      `json:"since,omitzero"`
	GIDs        []GIDStatus    `json:"gids,omitempty"`
	Resources   map[string]int `json:"resources,omitempty"`
	LockedBytes uint64         `json:"locked_bytes"`
	// LockedLimit is what the VM's QEMU may have the daemon map and lock
	// (its registered RAM plus LockSlack, or serve --vm-locked-default).
	LockedLimit uint64 `json:"locked_limit"`
	// Fault is why the device refused the guest, if it did (e.g. guest RAM
	// not shared).
	Fault    string            `json:"fault,omitempty"`
	Counters map[string]uint64 `json:"counters,omitempty"`
	// GIDAllow is the VM's allow list of GID prefixes ("none": only its
	// own link-local GID).
	GIDAllow []string `json:"gid_allow"`
	// RoCEMode is the VM's device's RoCE version: "v1" or "v2".
	RoCEMode string `json:"roce_mode"`
	// Doorbells is the VM's doorbell mode: "trapped" or "memory".
	Doorbells string `json:"doorbells"`
	// ReservedGIDs are the GIDs reserved to the VM (bound at least once
	// since it was registered), sorted.
	ReservedGIDs []string `json:"reserved_gids,omitempty"`
	// GIDRefusals counts the VM's refused GID binds; LastRefusedGID and
	// LastRefusedReason describe the latest.
	GIDRefusals       uint64 `json:"gid_refusals"`
	LastRefusedGID    string `json:"last_refused_gid,omitempty"`
	LastRefusedReason string `json:"last_refused_reason,omitempty"`
	// QMPSocket is where the VM's QEMU connects the daemon's monitor
	// (QEMUArgs' -chardev/-mon); QMP says what the daemon holds there:
	// QMPNone (migrations and snapshots of the VM are not guarded),
	// QMPConnected (a peer that is not, or not yet, the device's QEMU) or
	// QMPVerified (the QEMU connected to the device).
	QMPSocket string `json:"qmp_socket"`
	// QEMUUID is the only uid (besides root and the daemon's) the VM's
	// sockets admit; 0: any peer of the socket group (VMRequest.QEMUUID).
	QEMUUID uint32 `json:"qemu_uid,omitempty"`
	// QEMUCgroup is the cgroup the VM's sockets admit peers in (and
	// below); "": the libvirt machine rule (VMRequest.QEMUCgroup).
	QEMUCgroup string `json:"qemu_cgroup,omitempty"`
	// Identity says how the VM's sockets know its QEMU: "cgroup PATH",
	// "uid N" (both, comma-separated, if both are set), "libvirt machine
	// NAME" (the connected QEMU was admitted through its libvirt machine
	// cgroup NAME), or "socket group" (IdentitySocketGroup: any peer of
	// the socket group outside libvirt machine cgroups may connect as
	// the VM).
	Identity string `json:"identity"`
	QMP      string `json:"qmp"`
	// MigrationsCancelled and SnapshotsCancelled count the migrations and
	// snapshot jobs of the VM the daemon cancelled.
	MigrationsCancelled uint64 `json:"migrations_cancelled"`
	SnapshotsCancelled  uint64 `json:"snapshots_cancelled"`
}

// GIDStatus is one bound GID.
type GIDStatus struct {
	Index int    `json:"index"`
	GID   string `json:"gid"`
	Type  string `json:"type"`
}

// VMRequest registers a VM with a running daemon.
type VMRequest struct {
	Name string `json:"name"`
	MAC  string `json:"mac,omitempty"`
	// GIDAllow lists the GID prefixes (CIDR, or single addresses) the VM
	// may bind; absent means the daemon's default (serve --gid-allow),
	// ["none"] only the VM's own MAC-derived link-local GID.
	GIDAllow []string `json:"gid_allow,omitempty"`
	// MemBytes is the VM's RAM size: the guest memory its QEMU may map
	// and the daemon lock (plus LockSlack for firmware maps). 0 gives the
	// VM the daemon's default (serve --vm-locked-default, DefaultVMLocked:
	// a 1 GiB guest).
	MemBytes uint64 `json:"mem_bytes,omitempty"`
	// RoCEMode is the VM's RoCE version, "v1" or "v2"; absent means the
	// fabric's (serve --roce-mode).
	RoCEMode string `json:"roce_mode,omitempty"`
	// QEMUUID, if set, is the user ID the VM's QEMU runs as (libvirt's
	// per-domain DAC label, or a user of its own): the VM's sockets then
	// admit only peers with that uid (and root and the daemon's own
	// user), so that no other QEMU of the socket group can connect as
	// this VM. 0: any peer the socket group admits.
	QEMUUID uint32 `json:"qemu_uid,omitempty"`
	// QEMUCgroup, if set, is the cgroup the VM's QEMU runs in, as
	// /proc/PID/cgroup shows it to the daemon (a systemd scope of its own,
	// say /machine.slice/vm1.scope): the VM's sockets then admit only
	// peers in it or below it (the unified hierarchy's path, or
	// name=systemd's on a host without cgroup2), whatever their uid. A
	// VM without one admits no QEMU of another libvirt domain (a peer in
	// a libvirt machine cgroup that names another VM). CheckCgroupPath
	// says which paths are valid.
	QEMUCgroup string `json:"qemu_cgroup,omitempty"`
	// Doorbells is how the guest's user-space doorbells reach the daemon:
	// "trapped" (absent: every UAR write is a vfio-user round trip) or
	// "memory" (the UAR pages of user contexts are memory shared with
	// QEMU, which the daemon polls; docs/ARCHITECTURE.md, "Doorbells in
	// memory", says what differs).
	Doorbells string `json:"doorbells,omitempty"`
}

// Controller is what the control socket serves.
type Controller interface {
	Status() Status
	AddVM(VMRequest) (VMStatus, error)
	RemoveVM(name string) error
}

// Upgrader is a Controller that can hand itself over to a new binary
// (POST /v1/upgrade).
type Upgrader interface {
	StartUpgrade(binary string) error
}

// UpgradeRequest asks for a live upgrade; Binary empty means the daemon's
// own path (the package's new binary after an upgrade).
type UpgradeRequest struct {
	Binary string `json:"binary,omitempty"`
}

// ErrVMExists and ErrNoVM are Controller errors with HTTP meaning.
var (
	ErrVMExists = errors.New("VM already registered")
	ErrNoVM     = errors.New("no such VM")
	// ErrBadMAC: a VM request's MAC is not a 48-bit MAC.
	ErrBadMAC = errors.New("not a 48-bit MAC")
)

// ControlHandler serves the control API:
//
//	GET    /v1/status       Status as JSON
//	POST   /v1/vms          register a VM (VMRequest); creates its socket
//	DELETE /v1/vms/{name}   unregister a VM, disconnecting it
//	POST   /v1/upgrade      hand the daemon over to a new binary (UpgradeRequest)
//	GET    /metrics         Prometheus exposition (metrics.go): c's own
//	                        registry if c is a MetricsGatherer, else
//	                        c's Status rendered at each scrape
func ControlHandler(c Controller) http.Handler { return controlHandler(c, nil) }

// controlHandler is ControlHandler with a logger for what a scrape
// cannot collect.
func controlHandler(c Controller, log *slog.Logger) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, c.Status())
	})
	mux.HandleFunc("POST /v1/vms", func(w http.ResponseWriter, r *http.Request) {
		var req VMRequest
		dec := json.NewDecoder(io.LimitReader(r.Body, 4096))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&req); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("bad VM request: %w", err))
			return
		}
		st, err := c.AddVM(req)
		switch {
		case errors.Is(err, ErrVMExists):
			writeError(w, http.StatusConflict, err)
		case errors.Is(err, ErrBadVMName), errors.Is(err, ErrBadGIDPolicy), errors.Is(err, ErrBadMAC), errors.Is(err, ErrBadRoCEMode),
			errors.Is(err, ErrBadCgroup):
			writeError(w, http.StatusBadRequest, err)
		case err != nil:
			writeError(w, http.StatusInternalServerError, err)
		default:
			writeJSON(w, http.StatusCreated, st)
		}
	})
	mux.HandleFunc("DELETE /v1/vms/{name}", func(w http.ResponseWriter, r *http.Request) {
		err := c.RemoveVM(r.PathValue("name"))
		switch {
		case errors.Is(err, ErrNoVM):
			writeError(w, http.StatusNotFound, err)
		case err != nil:
			writeError(w, http.StatusInternalServerError, err)
		default:
			w.WriteHeader(http.StatusNoContent)
		}
	})
	mux.HandleFunc("POST /v1/upgrade", func(w http.ResponseWriter, r *http.Request) {
		u, ok := c.(Upgrader)
		if !ok {
			writeError(w, http.StatusNotImplemented, errors.New("this daemon cannot hand over"))
			return
		}
		var req UpgradeRequest
		dec := json.NewDecoder(io.LimitReader(r.Body, 4096))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&req); err != nil && !errors.Is(err, io.EOF) {
			writeError(w, http.StatusBadRequest, fmt.Errorf("bad upgrade request: %w", err))
			return
		}
		if err := u.StartUpgrade(req.Binary); err != nil {
			code := http.StatusConflict
			if errors.Is(err, ErrNoContinuity) {
				code = http.StatusPreconditionFailed
			}
			writeError(w, code, err)
			return
		}
		w.WriteHeader(http.StatusAccepted)
	})
	mux.Handle("GET /metrics", metricsHandler(c, log))
	return mux
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func writeError(w http.ResponseWriter, code int, err error) {
	writeJSON(w, code, map[string]string{"error": err.Error()})
}

// ListenControl creates the control socket at path (mode 0600), replacing
// a stale socket file left by a dead daemon but refusing to steal one that a
// live daemon still answers on.
func ListenControl(path string) (net.Listener, error) {
	if c, err := net.DialTimeout("unix", path, 200*time.Millisecond); err == nil {
		c.Close()
		return nil, fmt.Errorf("control socket %s: another daemon is listening", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("control socket %s: %w", path, err)
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("control socket: %w", err)
	}
	return ln, nil
}

// ControlClient talks to a daemon's control socket.
type ControlClient struct {
	hc *http.Client
}

// NewControlClient returns a client for the control socket at path.
func NewControlClient(path string) *ControlClient {
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}}
	return &ControlClient{hc: &http.Client{Transport: tr, Timeout: 10 * time.Second}}
}

// Close closes the client's idle connections to the daemon (a client
// used again opens new ones).
func (c *ControlClient) Close() { c.hc.CloseIdleConnections() }

func (c *ControlClient) do(ctx context.Context, method, path string, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://pvrdma"+path, rd)
	if err != nil {
		return err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("control socket: %w (is `pvrdma-backend serve` running?)", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode >= 300 {
		var e struct{ Error string }
		if json.Unmarshal(data, &e) == nil && e.Error != "" {
			return fmt.Errorf("%s %s: %s", method, path, e.Error)
		}
		return fmt.Errorf("%s %s: %s", method, path, resp.Status)
	}
	if out != nil {
		return json.Unmarshal(data, out)
	}
	return nil
}

// Status fetches the daemon's status.
func (c *ControlClient) Status(ctx context.Context) (Status, error) {
	var st Status
	err := c.do(ctx, http.MethodGet, "/v1/status", nil, &st)
	return st, err
}

// AddVM registers a VM.
func (c *ControlClient) AddVM(ctx context.Context, req VMRequest) (VMStatus, error) {
	var st VMStatus
	err := c.do(ctx, http.MethodPost, "/v1/vms", req, &st)
	return st, err
}

// RemoveVM unregisters a VM.
func (c *ControlClient) RemoveVM(ctx context.Context, name string) error {
	return c.do(ctx, http.MethodDelete, "/v1/vms/"+name, nil, nil)
}

// Upgrade asks the daemon to hand itself over to binary ("" its own
// path); it returns once the daemon accepted (watch Status().Handover).
func (c *ControlClient) Upgrade(ctx context.Context, binary string) error {
	return c.do(ctx, "POST", "/v1/upgrade", UpgradeRequest{Binary: binary}, nil)
}

// Metrics fetches the Prometheus exposition, in the text format.
func (c *ControlClient) Metrics(ctx context.Context) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://pvrdma/metrics", nil)
	if err != nil {
		return "", err
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := c.hc.Do(req)
	if err != nil {
		return "", fmt.Errorf("control socket: %w (is `pvrdma-backend serve` running?)", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err == nil && resp.StatusCode >= 300 {
		err = fmt.Errorf("GET /metrics: %s", resp.Status)
	}
	return string(b), err
}
