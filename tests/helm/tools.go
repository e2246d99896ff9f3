//go:build tools

// Package tools pins the Helm CLI that the chart's CI checks build (see build.sh).
package tools

import _ "helm.sh/helm/v3/cmd/helm"
