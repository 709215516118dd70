// Cluster DNS for the real node (e2e/cluster/node.py): CoreDNS with only the plugins a cluster's
// DNS needs here, so pods resolve Services and the JobSet's headless-service names exactly as on a
// real cluster. CoreDNS's own build lists every plugin (cloud DNS providers among them); a main
// package that imports the few it uses and sets the directive order is CoreDNS's documented way to
// build a smaller server (core/dnsserver.Directives, coremain.Run).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The order in which CoreDNS runs the plugins a server block names: their order in CoreDNS's plugin.cfg.
var directives = []string{"bind", "ready", "health", "errors", "log", "cache", "kubernetes"}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
