package supervise

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Environment the supervisor gives its worker, besides NOTIFY_SOCKET,
// LISTEN_FDS and LISTEN_FDNAMES.
const (
	// EnvSupervisor is the supervisor's PID: it marks the worker.
	EnvSupervisor = "PVRDMA_SUPERVISOR"
	// EnvRestarts counts the times the supervisor started a worker again
	// after one died.
	EnvRestarts = "PVRDMA_SUPERVISOR_RESTARTS"
	// EnvLastExit says how the previous worker ended ("killed by signal
	// SIGKILL", "exit status 2"); absent for the first.
	EnvLastExit = "PVRDMA_SUPERVISOR_LAST_EXIT"
)

// WorkerInfo is what a worker knows of its supervisor.
type WorkerInfo struct {
	SupervisorPID int
	Restarts      int
	LastExit      string
}

// Worker reports whether this process is a supervisor's worker (EnvSupervisor
// names its parent) and what the supervisor told it. A worker started with
// descriptors takes them: the supervisor cannot set LISTEN_PID to a PID it
// learns only after the fork (Go starts processes with their environment
// fixed before it), so the worker sets it to its own, as systemd would
// have, before anything reads LISTEN_FDS (sd_listen_fds(3), go-systemd's
// activation). Call it first thing in the worker.
func Worker() (WorkerInfo, bool) {
	sup, err := strconv.Atoi(os.Getenv(EnvSupervisor))
	if err != nil || sup <= 0 || os.Getppid() != sup {
		return WorkerInfo{}, false
	}
	info := WorkerInfo{SupervisorPID: sup, LastExit: os.Getenv(EnvLastExit)}
	info.Restarts, _ = strconv.Atoi(os.Getenv(EnvRestarts))
	if _, ok := os.LookupEnv("LISTEN_FDS"); ok {
		if _, ok := os.LookupEnv("LISTEN_PID"); !ok {
			_ = os.Setenv("LISTEN_PID", strconv.Itoa(os.Getpid()))
		}
	}
	return info, true
}

// workerEnv is env without the variables the supervisor sets for its
// worker (a supervisor started from a worker's environment, or under a
// service manager's leftovers, must not pass them on).
func workerEnv(env []string) []string {
	out := make([]string, 0, len(env))
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_FDNAMES", "LISTEN_PID", EnvSupervisor, EnvRestarts, EnvLastExit:
			continue
		}
		out = append(out, kv)
	}
	return out
}

// notifyDirPrefix begins the name of the directory a supervisor makes for
// its notify socket (notifyFile in it).
const (
	notifyDirPrefix = "pvrdma-supervisor-"
	notifyFile      = "notify"
)

// WorkerDone is what a worker does last: if its supervisor died before it
// (its parent is no longer the supervisor: a kill -9 of the supervisor
// sent it SIGTERM), it removes the supervisor's notify socket directory,
// which nobody else would.
func WorkerDone(info WorkerInfo) {
	if info.SupervisorPID == 0 || (os.Getppid() == info.SupervisorPID && !dying(info.SupervisorPID)) {
		return
	}
	sock := os.Getenv("NOTIFY_SOCKET")
	dir := filepath.Dir(sock)
	if filepath.Base(sock) != notifyFile || !strings.HasPrefix(filepath.Base(dir), notifyDirPrefix) {
		return
	}
	if fi, err := os.Lstat(dir); err != nil || !fi.IsDir() {
		return
	} else if st, ok := fi.Sys().(*syscall.Stat_t); !ok || int(st.Uid) != os.Getuid() {
		return
	}
	_ = os.Remove(sock)
	_ = os.Remove(dir)
}

// dying reports whether process pid is gone, a zombie, or being killed with SIGKILL.
// The parent-death signal fires when the thread that started the worker ends: when a
// kill -9 of the supervisor ends that thread first, the worker's parent is still
// another thread of the dying supervisor, and its PID is the supervisor's.
func dying(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return true
	}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "State":
			if strings.HasPrefix(v, "Z") || strings.HasPrefix(v, "X") {
				return true
			}
		case "ShdPnd":
			// A kill -9 stays pending for the whole thread group while it exits.
			if set, err := strconv.ParseUint(v, 16, 64); err == nil && set&(1<<(uint(syscall.SIGKILL)-1)) != 0 {
				return true
			}
		}
	}
	return false
}
