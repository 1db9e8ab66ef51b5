// Package supervise keeps a daemon's descriptors across its crashes when
// no service manager does: a small parent process that speaks the part of
// systemd's notify protocol (sd_notify(3)) a Type=notify service with a
// file descriptor store uses, runs the daemon as its child (the worker),
// holds the descriptors the worker stores, and starts the worker again
// after it dies, handing them back as systemd does (LISTEN_FDS,
// LISTEN_FDNAMES).
//
// pvrdma-backend keeps each VM's vfio-user connection, the files guest
// memory is mapped from, the interrupt eventfds and the fabric's receive
// sockets in the store (backend/continuity.go). QEMU's vfio-user client
// never reconnects, so whoever holds a copy of the connection decides
// whether a crash of the daemon costs the VM its device. Under systemd the
// unit's store holds them; run as a plain process (in a shell, a test
// bed, a CI job) nothing did, and a kill -9 closed every socket.
//
// What the supervisor understands, from the worker only (its PID,
// checked with SCM_CREDENTIALS, as systemd's NotifyAccess=main):
//
//   - READY=1, RELOADING=1, STOPPING=1, STATUS=, ERRNO=: logged; READY
//     ends the start timeout, and a worker that never became ready on its
//     first start is not restarted (a configuration error, not a crash).
//   - FDSTORE=1 with FDNAME= and SCM_RIGHTS: each descriptor is kept
//     under the name (Store), once per open file description however often
//     it is given (the first name stays), up to a limit.
//   - FDSTOREREMOVE=1 with FDNAME=: every descriptor of that name is
//     closed.
//   - FDPOLL=0: accepted; the supervisor never polls what it holds (as if
//     every descriptor had been stored with FDPOLL=0; systemd drops a
//     stored socket on POLLHUP or POLLERR, which the worker does itself).
//   - BARRIER=1 with one descriptor: closed once every message before it
//     was handled (sd_notify_barrier(3)).
//   - MAINPID=: only the worker's own PID is accepted: a live upgrade
//     execs the new binary in the worker's process, so the PID stays.
//
// Everything else is ignored. The notify socket is a datagram socket in a
// directory of the supervisor's own (mode 0700, under os.TempDir()), so
// other users cannot reach it; and, as on systemd's, the kernel's
// credentials decide whose messages count.
//
// The restart policy is the packaged unit's: Restart=on-failure (a worker
// that exits 0, or dies of SIGHUP, SIGINT, SIGTERM or SIGPIPE, stopped
// cleanly and is not restarted), RestartSec (Config.RestartDelay), and
// systemd's start limit (more than Config.Burst starts within
// Config.Interval end the supervisor with an error, closing what it
// held).
//
// The supervisor is small on purpose: one goroutine polls the notify
// socket, the worker's pidfd and a wake-up pipe; it reads into buffers
// allocated once, holds descriptors without mapping or reading them
// (guest memory is never touched), and logs through log/slog what it does.
package supervise
