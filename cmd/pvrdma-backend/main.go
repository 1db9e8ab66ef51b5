// Command pvrdma-backend is the host daemon that gives QEMU VMs VMware's
// paravirtual RDMA device (PVRDMA) over vfio-user, and its tools.
//
//	pvrdma-backend serve      run the daemon
//	pvrdma-backend qemu-args  print the QEMU arguments for a VM (and register it)
//	pvrdma-backend libvirt-xml  print a libvirt domain for a VM (and register it)
//	pvrdma-backend attach     hot-plug the device into a running VM over QMP
//	pvrdma-backend unregister remove a VM's registration from the daemon
//	pvrdma-backend status     show the daemon's VMs, devices and counters
//	pvrdma-backend upgrade    hand the running daemon over to its new binary (live upgrade)
//	pvrdma-backend doctor     check the host for what the daemon and its VMs need
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// defaultSocketDir is where the daemon puts one vfio-user socket per VM and
// its control socket.
const defaultSocketDir = "/run/pvrdma"

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"serve", "run the daemon", runServe},
		{"qemu-args", "print the QEMU arguments for a VM and register it with the daemon", runQEMUArgs},
		{"libvirt-xml", "print a libvirt domain giving a VM the device, and register it with the daemon", runLibvirtXML},
		{"attach", "hot-plug the device into a running VM over QMP", runAttach},
		{"unregister", "remove a VM's registration from the running daemon (its sockets, GIDs and kept state)", runUnregister},
		{"status", "show the daemon's VMs, devices and counters", runStatus},
		{"upgrade", "hand the running daemon over to its new binary without cutting its VMs", runUpgrade},
		{"check-state", "(used by upgrade) say whether this binary can take a running daemon's state", runCheckState},
		{"doctor", "check that this host has what the daemon and its VMs need", runDoctor},
		{"libvirt-hook", "libvirt's qemu hook: refuse migrate and restore of domains with the device", func(ctx context.Context, args []string, stdout, stderr io.Writer) error {
			return runLibvirtHook(args, os.Stdin, stderr)
		}},
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: pvrdma-backend <command> [flags]")
	fmt.Fprintln(w)
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-12s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w, "\nRun 'pvrdma-backend <command> -h' for a command's flags.")
}

// errUsage marks errors already explained by a usage message.
var errUsage = errors.New("usage")

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stderr)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, args[1:], stdout, stderr)
		switch {
		case err == nil:
			return 0
		case errors.Is(err, flag.ErrHelp):
			return 0
		case errors.Is(err, errUsage):
			return 2
		default:
			fmt.Fprintf(stderr, "pvrdma-backend %s: %v\n", c.name, err)
			return 1
		}
	}
	fmt.Fprintf(stderr, "pvrdma-backend: unknown command %q\n\n", args[0])
	usage(stderr)
	return 2
}

// newFlags returns a FlagSet that reports errors to stderr and whose usage
// names the command.
func newFlags(name, synopsis string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: pvrdma-backend %s %s\n\nflags:\n", name, synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// parse parses flags, mapping a parse error to errUsage (already printed).
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errUsage
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(fs.Output(), "unexpected arguments: %v\n", fs.Args())
		fs.Usage()
		return errUsage
	}
	return nil
}
