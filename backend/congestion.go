package backend

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/pvrdma-backend/pvrdma-backend/hostverbs/soft"
)

// ErrBadCongestion: a congestion control setting does not parse.
var ErrBadCongestion = errors.New("bad congestion control setting")

// ParseCongestion parses serve --dcqcn: "on" (or empty: the defaults of
// soft.DefaultCongestion), "off", or comma-separated KEY=VALUE settings
// over the defaults: line-rate, min-rate, ai-rate, hai-rate (bits per
// second, K/M/G suffixes), cnp-interval, alpha-period, rate-timer,
// reduction-period, cnp-window (durations such as 50us), byte-counter (bytes, K/M/G), g (a fraction
// such as 1/256 or 0.004) and f (fast recovery steps).
func ParseCongestion(s string) (soft.CongestionConfig, error) {
	var c soft.CongestionConfig
	switch strings.TrimSpace(s) {
	case "", "on":
		return c, nil
	case "off":
		c.Disabled = true
		return c, nil
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok {
			return c, fmt.Errorf("dcqcn %q: want KEY=VALUE: %w", kv, ErrBadCongestion)
		}
		var err error
		switch k {
		case "line-rate":
			c.LineRate, err = parseRate(v)
		case "min-rate":
			c.MinRate, err = parseRate(v)
		case "ai-rate":
			c.AIRate, err = parseRate(v)
		case "hai-rate":
			c.HAIRate, err = parseRate(v)
		case "cnp-interval":
			c.CNPInterval, err = time.ParseDuration(v)
		case "alpha-period":
			c.AlphaPeriod, err = time.ParseDuration(v)
		case "reduction-period":
			c.RateReductionPeriod, err = time.ParseDuration(v)
		case "cnp-window":
			c.CNPWindow, err = time.ParseDuration(v)
		case "rate-timer":
			c.RateIncreasePeriod, err = time.ParseDuration(v)
		case "byte-counter":
			c.ByteCounter, err = ParseSize(v)
		case "g":
			c.AlphaG, err = parseFraction(v)
		case "f":
			c.FastRecoverySteps, err = strconv.Atoi(v)
		default:
			return c, fmt.Errorf("dcqcn: unknown setting %q: %w", k, ErrBadCongestion)
		}
		if err != nil {
			return c, fmt.Errorf("dcqcn %s=%q: %v: %w", k, v, err, ErrBadCongestion)
		}
	}
	return c, nil
}

// parseRate parses bits per second with an optional K, M or G suffix
// (powers of 1000).
func parseRate(v string) (float64, error) {
	mult := 1.0
	switch {
	case strings.HasSuffix(v, "K"):
		mult, v = 1e3, strings.TrimSuffix(v, "K")
	case strings.HasSuffix(v, "M"):
		mult, v = 1e6, strings.TrimSuffix(v, "M")
	case strings.HasSuffix(v, "G"):
		mult, v = 1e9, strings.TrimSuffix(v, "G")
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f <= 0 {
		return 0, errors.New("want a positive rate such as 25G or 5M")
	}
	return f * mult, nil
}

// parseFraction parses "a/b" or a decimal.
func parseFraction(v string) (float64, error) {
	if a, b, ok := strings.Cut(v, "/"); ok {
		x, err1 := strconv.ParseFloat(a, 64)
		y, err2 := strconv.ParseFloat(b, 64)
		if err1 != nil || err2 != nil || y == 0 {
			return 0, errors.New("want a fraction such as 1/256")
		}
		return x / y, nil
	}
	return strconv.ParseFloat(v, 64)
}
