package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// TestE2EOpsConnectionLimit checks a tenant's max_connections: each client
// connection counts against its tenant from its first authenticated request
// until it closes; one over the cap is refused with 429 connection_limit and
// closed, and a slot frees up when a connection closes. Another tenant is not
// affected.
func TestE2EOpsConnectionLimit(t *testing.T) {
	env := newE2EEnv(t)
	dns := startTestDNS(t, map[string][]string{"plain.test": {"127.0.0.1"}})
	origin := startHTTPOrigin(t, "127.0.0.1:0")
	capped := env.StaticCredential("capped", "capped-ci")
	other := env.StaticCredential("other", "other-ci")
	const maxConns = 2
	cfg := fmt.Sprintf(opsHeader, "5s") + fmt.Sprintf(`tenants:
  - id: capped
%s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - host: plain.test
        ports: [%d]
    limits: {max_connections: %d}
  - id: other
%s    allow_private_cidrs: [127.0.0.0/8]
    allow:
      - host: plain.test
        ports: [%d]
`, opsCred(capped), origin.Port, maxConns, opsCred(other), origin.Port)
	p := env.StartSluice(cfg, sluiceOptions{Resolver: dns.Addr})
	target := fmt.Sprintf("http://plain.test:%d/", origin.Port)

	type client struct {
		conn net.Conn
		br   *bufio.Reader
	}
	dial := func() client {
		c, err := net.DialTimeout("tcp", p.ProxyAddr, e2eTimeout)
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(e2eTimeout))
		t.Cleanup(func() { c.Close() })
		return client{conn: c, br: bufio.NewReader(c)}
	}
	get := func(c client, cred testCredential) (*http.Response, []byte) {
		t.Helper()
		req := fmt.Sprintf("GET %s HTTP/1.1\r\nHost: plain.test:%d\r\nProxy-Authorization: %s\r\n\r\n", target, origin.Port, proxyAuthorization(cred))
		if _, err := io.WriteString(c.conn, req); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(c.br, nil)
		if err != nil {
			t.Fatalf("reading response: %v", err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, body
	}

	mark := p.AuditMark(t)
	var open []client
	for i := range maxConns {
		c := dial()
		if resp, body := get(c, capped); resp.StatusCode != http.StatusOK {
			t.Fatalf("connection %d: %d %q", i, resp.StatusCode, body)
		}
		// A second request on the same connection does not count again.
		if resp, body := get(c, capped); resp.StatusCode != http.StatusOK {
			t.Fatalf("connection %d, second request: %d %q", i, resp.StatusCode, body)
		}
		open = append(open, c)
	}
	over := dial()
	resp, body := get(over, capped)
	checkDenial(t, "connection over the cap", resp, body, http.StatusTooManyRequests, "connection_limit")
	if !resp.Close {
		t.Error("the refused connection was not closed")
	}
	// The cap is the tenant's own: another tenant still gets in.
	if resp, body := get(dial(), other); resp.StatusCode != http.StatusOK {
		t.Fatalf("other tenant: %d %q", resp.StatusCode, body)
	}
	recs := p.WaitRecords(t, mark, 2*maxConns+2)
	refused := 0
	for _, r := range recs {
		if r.Reason == "connection_limit" {
			refused++
			if r.Tenant != "capped" || r.Status != http.StatusTooManyRequests {
				t.Errorf("refusal record %+v", r)
			}
		}
	}
	if refused != 1 {
		t.Errorf("%d connection_limit records, want 1", refused)
	}

	// Closing one connection frees its slot.
	open[0].conn.Close()
	deadline := time.Now().Add(e2eTimeout)
	for {
		resp, body := get(dial(), capped)
		if resp.StatusCode == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("slot never freed: %d %q", resp.StatusCode, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
