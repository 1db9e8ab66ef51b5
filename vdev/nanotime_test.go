package vdev

import "time"

var clockBase = time.Now()

func nanotime() int64 { return int64(time.Since(clockBase)) }
