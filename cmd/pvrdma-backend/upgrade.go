package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/backend"
)

// runUpgrade asks the running daemon to hand itself over to a new binary
// (its own path by default: after `apt upgrade`, the new one) and waits
// until the new daemon serves. The unit's ExecReload runs it, so
// `systemctl reload pvrdma-backend` is a live upgrade.
func runUpgrade(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("upgrade", "[flags]", stderr)
	socketDir := fs.String("socket-dir", defaultSocketDir, "daemon socket directory")
	binary := fs.String("binary", "", "binary to hand over to (default: the daemon's own path)")
	timeout := fs.Duration("timeout", 30*time.Second, "how long to wait for the new daemon")
	if err := parse(fs, args); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	c := backend.NewControlClient(controlPath(*socketDir))
	before, err := c.Status(ctx)
	if err != nil {
		return err
	}
	gen := 0
	if before.Handover != nil {
		gen = before.Handover.Generation
	}
	if err := c.Upgrade(ctx, *binary); err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("the new daemon did not answer within %v: %w", *timeout, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
		st, err := c.Status(ctx)
		if err != nil {
			continue // the daemon is between images
		}
		h := st.Handover
		if h == nil {
			continue
		}
		if h.Generation > gen {
			if h.PauseMS == 0 && h.VMs > 0 {
				continue // still resuming its VMs
			}
			fmt.Fprintf(stdout, "handed over (generation %d): %d VMs resumed, pause %.1f ms (saving %.1f, starting %.1f, resuming %.1f), RC QPs kept %d, errored %d, objects lost %d\n",
				h.Generation, h.VMs, h.PauseMS, h.SaveMS, h.StartMS, h.ResumeMS, h.Continued, h.Errored, h.Lost)
			return nil
		}
		if h.Error != "" && (before.Handover == nil || h.Error != before.Handover.Error) {
			return errors.New("the daemon refused or failed the hand-over and serves on: " + h.Error)
		}
	}
}

// runCheckState is what a daemon asks its successor before a live upgrade:
// can this binary take the state in the directory (and the journal
// features named)? It prints a line per VM and exits 1 with the reason if
// not.
func runCheckState(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlags("check-state", "[flags]", stderr)
	dir := fs.String("state-dir", defaultSocketDir+"/state", "the daemon's state directory")
	need := fs.String("need", "", "journal features the state uses, comma separated (transport)")
	if err := parse(fs, args); err != nil {
		return err
	}
	lines, err := backend.CheckState(*dir, strings.Split(*need, ","))
	for _, l := range lines {
		fmt.Fprintln(stdout, l)
	}
	if err == nil {
		fmt.Fprintln(stdout, backend.FeaturesLine())
	}
	return err
}
