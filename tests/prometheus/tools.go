//go:build tools

// Package tools pins the Prometheus server and promtool that the observability test builds (see
// build.sh).
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
