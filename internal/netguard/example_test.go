package netguard_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/netip"
	"time"

	"github.com/sluicehq/sluice/internal/netguard"
)

// The proxy builds one Guard and one upstream transport on it, and puts each
// tenant's exceptions in the request context.
func ExampleGuard_DialContext() {
	guard, err := netguard.New(netguard.Options{
		Resolver:    "127.0.0.53:53",
		DialTimeout: 10 * time.Second,
		DenyAddrs: []netip.AddrPort{
			netip.MustParseAddrPort("127.0.0.1:3128"), // proxy listener
			netip.MustParseAddrPort("127.0.0.1:9090"), // admin listener
		},
		Logger: slog.Default(),
	})
	if err != nil {
		panic(err)
	}
	upstream := &http.Transport{
		Proxy:       nil, // never HTTP_PROXY from the proxy's own environment
		DialContext: guard.DialContext,
	}
	_ = upstream

	exceptions, err := netguard.ParseExceptions([]string{"10.20.0.0/16"}) // a tenant's allow_private_cidrs
	if err != nil {
		panic(err)
	}
	ctx := netguard.WithExceptions(context.Background(), exceptions)
	_ = ctx // req = req.WithContext(ctx) before upstream.RoundTrip(req)
}
