package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"

	"github.com/sluicehq/sluice/internal/audit"
	"github.com/sluicehq/sluice/rules"
)

// newRecord starts the audit record of a request.
func (s *Server) newRecord(req *http.Request, tun *tunnel) *audit.Record {
	rec := &audit.Record{
		Time:   s.opts.Now().UTC(),
		Kind:   audit.KindRequest,
		ID:     s.nextID(),
		Client: req.RemoteAddr,
		Method: req.Method,
	}
	if tun != nil {
		rec.TunnelID = tun.id
		rec.Intercepted = true
		rec.Tenant, rec.Sandbox = tun.principal.Tenant, tun.principal.Sandbox
	}
	return rec
}

// denialBody is what a sandbox reads when sluice refuses a request: enough to
// tell "blocked by policy" from "network down", and nothing internal (no
// addresses, no raw dial errors).
type denialBody struct {
	Error     string `json:"error"`
	Reason    string `json:"reason"`
	Host      string `json:"host,omitempty"`
	Rule      string `json:"rule,omitempty"`
	RequestID string `json:"request_id"`
}

// deny records a refusal and builds the response for it. If the record
// cannot be written the client still gets a refusal (it was refused anyway).
func (s *Server) deny(ctx context.Context, rec *audit.Record, req *http.Request, status int, reason rules.Reason, rule string) *http.Response {
	if rec.Decision == "" || rec.Decision == audit.DecisionAllow || rec.Decision == audit.DecisionWouldDeny {
		rec.Decision = audit.DecisionDeny
	}
	rec.Reason = string(reason)
	if rule != "" {
		rec.Rule = rule
	}
	rec.Status = status
	rec.DurationMS = float64(s.opts.Now().Sub(rec.Time).Microseconds()) / 1000
	if rec.Kind == audit.KindRequest || rec.Kind == audit.KindAuthFailure {
		s.opts.Observer.Decision(rec.Tenant, string(rec.Decision), reason, rec.DurationMS/1000)
	}
	_ = s.write(context.WithoutCancel(ctx), rec)
	return denialResponse(req, status, reason, rec.Host, rule, rec.ID)
}

func denialResponse(req *http.Request, status int, reason rules.Reason, host, rule, id string) *http.Response {
	body, _ := json.Marshal(denialBody{
		Error:     errorText(status),
		Reason:    string(reason),
		Host:      host,
		Rule:      rule,
		RequestID: id,
	})
	body = append(body, '\n')
	h := make(http.Header, 4)
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set("X-Sluice-Reason", string(reason))
	h.Set("X-Sluice-Request-Id", id)
	return &http.Response{
		StatusCode:    status,
		Status:        strconv.Itoa(status) + " " + http.StatusText(status),
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          io.NopCloser(bytes.NewReader(body)),
		ContentLength: int64(len(body)),
		Request:       req,
	}
}

func errorText(status int) string {
	switch status {
	case http.StatusProxyAuthRequired:
		return "proxy authentication required"
	case http.StatusForbidden:
		return "blocked by sluice policy"
	case http.StatusTooManyRequests:
		return "rate limited by sluice"
	case http.StatusServiceUnavailable:
		return "sluice cannot serve this request now"
	case http.StatusBadGateway, http.StatusGatewayTimeout:
		return "upstream failed"
	}
	return "request refused by sluice"
}

// clientAddr is the client's IP, for the per-source auth throttle.
func clientAddr(req *http.Request) netip.Addr {
	host, _, err := net.SplitHostPort(req.RemoteAddr)
	if err != nil {
		host = req.RemoteAddr
	}
	a, err := netip.ParseAddr(host)
	if err != nil {
		return netip.Addr{}
	}
	return a.Unmap()
}
