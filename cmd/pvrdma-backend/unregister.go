package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

// unregisterFirst is the advice of an error about a VM registered
// otherwise than asked: the command that removes its registration.
func unregisterFirst(socketDir, name string) string {
	cmd := "pvrdma-backend unregister " + name
	if socketDir != defaultSocketDir {
		cmd += " --socket-dir " + shellQuote(socketDir)
	}
	return "unregister it first (" + cmd + ")"
}

// runUnregister removes a VM's registration from the running daemon
// (DELETE /v1/vms/NAME on its control socket): its sockets go, its GIDs
// are released and its kept state is forgotten. A VM whose QEMU is
// connected loses its device; that takes --force.
func runUnregister(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("unregister", "[flags] VM", stderr)
	socketDir := fs.String("socket-dir", defaultSocketDir, "daemon socket directory")
	force := fs.Bool("force", false, "unregister the VM even if its QEMU is connected (its device is then dead until that QEMU restarts)")
	// The VM's name may come before, between or after the flags.
	var names []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return err
			}
			return errUsage
		}
		if fs.NArg() == 0 {
			break
		}
		names, args = append(names, fs.Arg(0)), fs.Args()[1:]
	}
	if len(names) != 1 {
		fs.Usage()
		return errUsage
	}
	name := names[0]
	if err := backend.CheckVMName(name); err != nil {
		return err
	}
	c := backend.NewControlClient(controlPath(*socketDir))
	defer c.Close()
	st, err := c.Status(ctx)
	if err != nil {
		return fmt.Errorf("no daemon answers on %s: %w", controlPath(*socketDir), err)
	}
	var vm *backend.VMStatus
	var known []string
	for i := range st.VMs {
		known = append(known, st.VMs[i].Name)
		if st.VMs[i].Name == name {
			vm = &st.VMs[i]
		}
	}
	if vm == nil {
		list := "none"
		if len(known) > 0 {
			list = strings.Join(known, ", ")
		}
		return fmt.Errorf("VM %s is not registered with the daemon on %s (its VMs: %s)", name, *socketDir, list)
	}
	if vm.Connected && !*force {
		return fmt.Errorf("VM %s is connected: its QEMU would lose the device until it restarts; "+
			"shut the VM down first, or pass --force", name)
	}
	if err := c.RemoveVM(ctx, name); err != nil {
		if strings.Contains(err.Error(), backend.ErrNoVM.Error()) {
			return fmt.Errorf("VM %s is not registered with the daemon on %s", name, *socketDir)
		}
		return fmt.Errorf("unregister %s: %w", name, err)
	}
	if vm.Connected {
		fmt.Fprintf(stdout, "unregistered %s and disconnected its QEMU\n", name)
	} else {
		fmt.Fprintf(stdout, "unregistered %s\n", name)
	}
	return nil
}
