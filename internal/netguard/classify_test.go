package netguard

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"testing"
)

// teredo builds a Teredo address for a server and a client IPv4 address, the
// client stored bit-inverted as RFC 4380 says.
func teredo(server, client string) netip.Addr {
	s, c := netip.MustParseAddr(server).As4(), netip.MustParseAddr(client).As4()
	var a [16]byte
	a[0], a[1] = 0x20, 0x01
	copy(a[4:8], s[:])
	a[8], a[9] = 0x80, 0x00   // flags
	a[10], a[11] = 0x63, 0xbf // obfuscated port
	for i := range 4 {
		a[12+i] = ^c[i]
	}
	return netip.AddrFrom16(a)
}

func TestClassify(t *testing.T) {
	cases := []struct {
		ip    string
		class string
	}{
		// 0.0.0.0/8
		{"0.0.0.0", ClassUnspecified}, {"0.255.255.255", ClassUnspecified}, {"1.0.0.0", ClassPublic},
		// 10/8
		{"9.255.255.255", ClassPublic}, {"10.0.0.0", ClassPrivate}, {"10.255.255.255", ClassPrivate}, {"11.0.0.0", ClassPublic},
		// 100.64/10 and Alibaba metadata inside it
		{"100.63.255.255", ClassPublic}, {"100.64.0.0", ClassCGNAT}, {"100.127.255.255", ClassCGNAT}, {"100.128.0.0", ClassPublic},
		{"100.100.100.199", ClassCGNAT}, {"100.100.100.200", ClassMetadata}, {"100.100.100.201", ClassCGNAT},
		// 127/8
		{"126.255.255.255", ClassPublic}, {"127.0.0.0", ClassLoopback}, {"127.0.0.1", ClassLoopback}, {"127.255.255.255", ClassLoopback}, {"128.0.0.0", ClassPublic},
		// Azure WireServer
		{"168.63.129.15", ClassPublic}, {"168.63.129.16", ClassMetadata}, {"168.63.129.17", ClassPublic},
		// 169.254/16 and metadata
		{"169.253.255.255", ClassPublic}, {"169.254.0.0", ClassLinkLocal}, {"169.254.169.253", ClassLinkLocal},
		{"169.254.169.254", ClassMetadata}, {"169.254.169.255", ClassLinkLocal}, {"169.254.170.2", ClassMetadata},
		{"169.254.255.255", ClassLinkLocal}, {"169.255.0.0", ClassPublic},
		// 172.16/12
		{"172.15.255.255", ClassPublic}, {"172.16.0.0", ClassPrivate}, {"172.16.0.1", ClassPrivate}, {"172.31.255.255", ClassPrivate}, {"172.32.0.0", ClassPublic},
		// 192.0.0/24, Oracle metadata, TEST-NET-1, 6to4 relay
		{"191.255.255.255", ClassPublic}, {"192.0.0.0", ClassReserved}, {"192.0.0.192", ClassMetadata}, {"192.0.0.255", ClassReserved}, {"192.0.1.0", ClassPublic},
		{"192.0.2.0", ClassReserved}, {"192.0.2.255", ClassReserved}, {"192.0.3.0", ClassPublic},
		{"192.88.98.255", ClassPublic}, {"192.88.99.0", ClassReserved}, {"192.88.99.255", ClassReserved}, {"192.88.100.0", ClassPublic},
		// 192.168/16
		{"192.167.255.255", ClassPublic}, {"192.168.0.0", ClassPrivate}, {"192.168.1.1", ClassPrivate}, {"192.168.255.255", ClassPrivate}, {"192.169.0.0", ClassPublic},
		// 198.18/15, TEST-NET-2, TEST-NET-3
		{"198.17.255.255", ClassPublic}, {"198.18.0.0", ClassReserved}, {"198.19.255.255", ClassReserved}, {"198.20.0.0", ClassPublic},
		{"198.51.99.255", ClassPublic}, {"198.51.100.0", ClassReserved}, {"198.51.100.255", ClassReserved}, {"198.51.101.0", ClassPublic},
		{"203.0.112.255", ClassPublic}, {"203.0.113.0", ClassReserved}, {"203.0.113.5", ClassReserved}, {"203.0.113.255", ClassReserved}, {"203.0.114.0", ClassPublic},
		// multicast, future use, broadcast
		{"223.255.255.255", ClassPublic}, {"224.0.0.0", ClassMulticast}, {"239.255.255.255", ClassMulticast},
		{"240.0.0.0", ClassReserved}, {"255.255.255.254", ClassReserved}, {"255.255.255.255", ClassReserved},
		{"8.8.8.8", ClassPublic}, {"1.1.1.1", ClassPublic},

		// IPv6 specials and the IPv4-in-IPv6 forms
		{"::", ClassUnspecified}, {"::1", ClassLoopback}, {"::2", ClassReserved},
		{"::ffff:127.0.0.1", ClassLoopback}, {"::ffff:10.0.0.1", ClassPrivate}, {"::ffff:169.254.169.254", ClassMetadata}, {"::ffff:8.8.8.8", ClassPublic},
		{"::ffff:0:127.0.0.1", ClassReserved}, {"::ffff:0:8.8.8.8", ClassReserved}, // IPv4-translated
		{"::127.0.0.1", ClassReserved}, {"::8.8.8.8", ClassReserved}, {"::ffff:ffff", ClassReserved}, // IPv4-compatible
		{"::1:0:0:0", ClassReserved},
		// NAT64 well-known prefix
		{"64:ff9b::7f00:1", ClassNAT64}, {"64:ff9b::10.0.0.1", ClassNAT64}, {"64:ff9b::169.254.169.254", ClassNAT64},
		{"64:ff9b::8.8.8.8", ClassPublic}, {"64:ff9b::1:0:0", ClassReserved}, {"64:ff9a:ffff:ffff:ffff:ffff:ffff:ffff", ClassReserved},
		// NAT64 local-use prefix: /96 layout verified, others refused
		{"64:ff9b:1::8.8.8.8", ClassPublic}, {"64:ff9b:1::127.0.0.1", ClassNAT64}, {"64:ff9b:1:808:8:800::", ClassNAT64},
		{"64:ff9b:1:ffff:ffff:ffff:ffff:ffff", ClassNAT64}, {"64:ff9b:2::8.8.8.8", ClassReserved},
		// discard-only
		{"100::", ClassReserved}, {"100::ffff:ffff:ffff:ffff", ClassReserved},
		// 2001::/23 with Teredo carved out, documentation
		{"2001:1::1", ClassReserved}, {"2001:1ff:ffff:ffff::", ClassReserved}, {"2001:200::", ClassPublic},
		{"2001:db7:ffff:ffff:ffff:ffff:ffff:ffff", ClassPublic}, {"2001:db8::", ClassReserved}, {"2001:db8:ffff:ffff:ffff:ffff:ffff:ffff", ClassReserved}, {"2001:db9::", ClassPublic},
		{teredo("65.54.227.120", "127.0.0.1").String(), ClassTeredo},
		{teredo("65.54.227.120", "192.168.1.1").String(), ClassTeredo},
		{teredo("10.0.0.1", "8.8.8.8").String(), ClassTeredo},
		{teredo("65.54.227.120", "8.8.8.8").String(), ClassPublic},
		{"2001:0:4136:e378:8000:63bf:80ff:fffe", ClassTeredo}, // client ^80ff:fffe = 127.0.0.1
		// 6to4
		{"2001:ffff::", ClassPublic}, {"2002:7f00:1::1", Class6to4}, {"2002:a9fe:a9fe::", Class6to4}, {"2002:c0a8:101::", Class6to4},
		{"2002:a00:1::", Class6to4}, {"2002:808:808::1", ClassPublic}, {"2003::", ClassPublic},
		// documentation 3fff::/20, and the 2000::/3 boundaries
		{"3ffe:ffff::", ClassPublic}, {"3fff::", ClassReserved}, {"3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff", ClassReserved}, {"3fff:1000::", ClassPublic},
		{"1fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", ClassReserved}, {"2000::", ClassPublic}, {"4000::", ClassReserved}, {"5f00::1", ClassReserved},
		{"2606:4700:4700::1111", ClassPublic},
		// ULA with the AWS metadata address inside, link-local, site-local, multicast
		{"fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", ClassReserved}, {"fc00::", ClassULA}, {"fc00::1", ClassULA},
		{"fd00:ec2::253", ClassULA}, {"fd00:ec2::254", ClassMetadata}, {"fd00:ec2::255", ClassULA}, {"fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", ClassULA},
		{"fe00::", ClassReserved}, {"fe7f:ffff:ffff:ffff:ffff:ffff:ffff:ffff", ClassReserved},
		{"fe80::", ClassLinkLocal}, {"fe80::1", ClassLinkLocal}, {"febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff", ClassLinkLocal},
		{"fec0::", ClassReserved}, {"feff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", ClassReserved},
		{"ff00::", ClassMulticast}, {"ff02::1", ClassMulticast}, {"ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", ClassMulticast},
		{"fe80::1%eth0", ClassLinkLocal},
	}
	for _, c := range cases {
		ip := netip.MustParseAddr(c.ip)
		class, forbidden := Classify(ip)
		if class != c.class {
			t.Errorf("Classify(%s) = %q, want %q", c.ip, class, c.class)
		}
		if forbidden != (c.class != ClassPublic) {
			t.Errorf("Classify(%s) forbidden = %v, want %v", c.ip, forbidden, c.class != ClassPublic)
		}
		err := Check(ip, nil)
		var de *DeniedError
		switch {
		case c.class == ClassPublic && err != nil:
			t.Errorf("Check(%s) = %v, want nil", c.ip, err)
		case c.class != ClassPublic && !errors.As(err, &de):
			t.Errorf("Check(%s) = %v, want *DeniedError", c.ip, err)
		case c.class != ClassPublic && de.Class != c.class && ip.Zone() == "":
			t.Errorf("Check(%s) class = %q, want %q", c.ip, de.Class, c.class)
		}
	}
}

func TestClassifyInvalid(t *testing.T) {
	if class, forbidden := Classify(netip.Addr{}); class != ClassInvalid || !forbidden {
		t.Fatalf("Classify(zero) = %q, %v", class, forbidden)
	}
	err := Check(netip.Addr{}, []netip.Prefix{netip.MustParsePrefix("0.0.0.0/1")})
	if !errors.Is(err, ErrDenied) {
		t.Fatalf("Check(zero) = %v, want refusal", err)
	}
}

// tableSpec4 and tableSpec6 spell out, row for row, the prefixes the numeric
// tables in classify.go must hold.
var tableSpec4 = []struct{ cidr, class string }{
	{"0.0.0.0/8", ClassUnspecified}, {"10.0.0.0/8", ClassPrivate}, {"100.100.100.200/32", ClassMetadata},
	{"100.64.0.0/10", ClassCGNAT}, {"127.0.0.0/8", ClassLoopback}, {"168.63.129.16/32", ClassMetadata},
	{"169.254.169.254/32", ClassMetadata}, {"169.254.170.2/32", ClassMetadata}, {"169.254.0.0/16", ClassLinkLocal},
	{"172.16.0.0/12", ClassPrivate}, {"192.0.0.192/32", ClassMetadata}, {"192.0.0.0/24", ClassReserved},
	{"192.0.2.0/24", ClassReserved}, {"192.88.99.0/24", ClassReserved}, {"192.168.0.0/16", ClassPrivate},
	{"198.18.0.0/15", ClassReserved}, {"198.51.100.0/24", ClassReserved}, {"203.0.113.0/24", ClassReserved},
	{"224.0.0.0/4", ClassMulticast}, {"255.255.255.255/32", ClassReserved}, {"240.0.0.0/4", ClassReserved},
}

var tableSpec6 = []struct{ cidr, class string }{
	{"::/128", ClassUnspecified}, {"::1/128", ClassLoopback}, {"::ffff:0:0:0/96", ClassReserved}, {"::/96", ClassReserved},
	{"64:ff9b::/96", ClassNAT64}, {"64:ff9b:1::/48", ClassNAT64}, {"100::/64", ClassReserved},
	{"2001::/32", ClassTeredo}, {"2001::/23", ClassReserved}, {"2001:db8::/32", ClassReserved}, {"2002::/16", Class6to4},
	{"3fff::/20", ClassReserved}, {"fd00:ec2::254/128", ClassMetadata}, {"fc00::/7", ClassULA},
	{"fe80::/10", ClassLinkLocal}, {"fec0::/10", ClassReserved}, {"ff00::/8", ClassMulticast},
}

// TestTablesMatchSpec keeps the numeric tables honest: every row must be
// exactly the prefix and class the spec names, and no row may be shadowed by
// an earlier, wider one (first match wins, so it would never be reached).
func TestTablesMatchSpec(t *testing.T) {
	t4, t6 := table4(), table6()
	if len(t4) != len(tableSpec4) || len(t6) != len(tableSpec6) {
		t.Fatalf("table sizes %d/%d, spec sizes %d/%d", len(t4), len(t6), len(tableSpec4), len(tableSpec6))
	}
	var p4, p6 []netip.Prefix
	for i, r := range t4 {
		spec := tableSpec4[i]
		p := netip.MustParsePrefix(spec.cidr)
		a := p.Addr().As4()
		if !p.Addr().Is4() || p != p.Masked() || binary.BigEndian.Uint32(a[:]) != r.net || p.Bits() != int(r.bits) || r.kind.class() != spec.class {
			t.Errorf("row %d: %08x/%d %s, spec says %s %s", i, r.net, r.bits, r.kind.class(), spec.cidr, spec.class)
		}
		p4 = append(p4, p)
	}
	for i, r := range t6 {
		spec := tableSpec6[i]
		p := netip.MustParsePrefix(spec.cidr)
		a := p.Addr().As16()
		if !p.Addr().Is6() || p != p.Masked() || binary.BigEndian.Uint64(a[:8]) != r.hi || binary.BigEndian.Uint64(a[8:]) != r.lo ||
			p.Bits() != int(r.bits) || r.kind.class() != spec.class {
			t.Errorf("row %d: %016x %016x/%d %s, spec says %s %s", i, r.hi, r.lo, r.bits, r.kind.class(), spec.cidr, spec.class)
		}
		p6 = append(p6, p)
	}
	for _, ps := range [][]netip.Prefix{p4, p6} {
		for j := range ps {
			for i := range j {
				if ps[i].Bits() <= ps[j].Bits() && ps[i].Contains(ps[j].Addr()) {
					t.Errorf("%s is shadowed by earlier %s", ps[j], ps[i])
				}
			}
		}
	}
	// The first and last address of every IPv4 row classify as that row
	// (unless a narrower, earlier row owns them).
	for i, spec := range tableSpec4 {
		for _, a := range []netip.Addr{p4[i].Addr(), lastAddr(p4[i])} {
			if ownerIndex(p4, a) != i {
				continue
			}
			if class, _ := Classify(a); class != spec.class {
				t.Errorf("%s in %s classified %q, want %q", a, spec.cidr, class, spec.class)
			}
		}
	}
	for i := kPublic; i <= kTeredo; i++ {
		if i != kReserved && i.class() == ClassReserved {
			t.Errorf("kind %d has no class name", i)
		}
	}
}

func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Addr().AsSlice()
	for i := range b {
		bitsLeft := p.Bits() - 8*i
		switch {
		case bitsLeft <= 0:
			b[i] = 0xff
		case bitsLeft < 8:
			b[i] |= 0xff >> bitsLeft
		}
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}

func ownerIndex(ps []netip.Prefix, a netip.Addr) int {
	for i, p := range ps {
		if p.Contains(a) {
			return i
		}
	}
	return -1
}

func TestCheckExceptions(t *testing.T) {
	pfx := func(s ...string) []netip.Prefix {
		var out []netip.Prefix
		for _, x := range s {
			out = append(out, netip.MustParsePrefix(x))
		}
		return out
	}
	cases := []struct {
		ip         string
		exceptions []netip.Prefix
		allowed    bool
	}{
		{"10.1.2.3", pfx("10.0.0.0/8"), true},
		{"10.1.2.3", pfx("10.1.2.3/32"), true},
		{"10.1.2.4", pfx("10.1.2.3/32"), false},
		{"11.0.0.1", pfx("10.0.0.0/8"), true}, // public anyway
		{"192.168.1.1", pfx("10.0.0.0/8"), false},
		{"127.0.0.1", pfx("127.0.0.0/8"), true},
		{"::ffff:127.0.0.1", pfx("127.0.0.0/8"), true},   // mapped address, plain prefix
		{"127.0.0.1", pfx("::ffff:127.0.0.0/104"), true}, // plain address, mapped prefix
		{"::ffff:10.0.0.1", pfx("::ffff:0:0/95"), false}, // mapped prefix wider than /96 matches nothing unmapped
		{"::1", pfx("127.0.0.0/8"), false},
		{"::1", pfx("::1/128"), true},
		{"fc00::1", pfx("fc00::/7"), true},
		// never: unspecified, invalid, zoned
		{"0.0.0.0", pfx("0.0.0.0/8"), false},
		{"0.0.0.0", pfx("0.0.0.0/0"), false},
		{"::", pfx("::/0"), false},
		{"fe80::1%lo", pfx("fe80::/10"), false},
		// metadata only with an exact single-address exception
		{"169.254.169.254", pfx("169.254.0.0/16"), false},
		{"169.254.169.254", pfx("0.0.0.0/0"), false},
		{"169.254.169.254", pfx("169.254.169.254/32"), true},
		{"169.254.169.253", pfx("169.254.0.0/16"), true},
		{"fd00:ec2::254", pfx("fc00::/7"), false},
		{"fd00:ec2::254", pfx("fd00:ec2::254/128"), true},
		// embedded forms are matched as the IPv6 address they are
		{"64:ff9b::7f00:1", pfx("127.0.0.0/8"), false},
		{"64:ff9b::7f00:1", pfx("64:ff9b::/96"), true},
		// an invalid prefix matches nothing
		{"10.0.0.1", []netip.Prefix{{}}, false},
	}
	for _, c := range cases {
		err := Check(netip.MustParseAddr(c.ip), c.exceptions)
		if c.allowed && err != nil {
			t.Errorf("Check(%s, %v) = %v, want allowed", c.ip, c.exceptions, err)
		}
		if !c.allowed && !errors.Is(err, ErrDenied) {
			t.Errorf("Check(%s, %v) = %v, want refused", c.ip, c.exceptions, err)
		}
	}
}

func TestCheckZonedClass(t *testing.T) {
	var de *DeniedError
	if err := Check(netip.MustParseAddr("2606:4700::1111%eth0"), nil); !errors.As(err, &de) || de.Class != ClassZoned {
		t.Fatalf("Check(zoned public) = %v, want class %q", err, ClassZoned)
	}
}

func TestCheckDoesNotAllocate(t *testing.T) {
	exc := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("::ffff:192.168.0.0/112")}
	for _, s := range []string{"8.8.8.8", "2606:4700::1111", "10.9.8.7", "::ffff:192.168.1.1", "64:ff9b::8.8.8.8", "2002:808:808::"} {
		ip := netip.MustParseAddr(s)
		if n := testing.AllocsPerRun(100, func() {
			if Check(ip, exc) != nil {
				panic("refused " + s)
			}
		}); n != 0 {
			t.Errorf("Check(%s) allocates %.0f times", s, n)
		}
	}
	for _, s := range []string{"127.0.0.1", "fd00:ec2::254", "2001:0:4136:e378:8000:63bf:80ff:fffe"} {
		ip := netip.MustParseAddr(s)
		if n := testing.AllocsPerRun(100, func() { Classify(ip) }); n != 0 {
			t.Errorf("Classify(%s) allocates %.0f times", s, n)
		}
	}
}

func TestDeniedErrorMessage(t *testing.T) {
	err := error(&DeniedError{Host: "meta.test", IP: netip.MustParseAddr("169.254.169.254"), Port: 80, Class: ClassMetadata})
	want := `netguard: refused "meta.test" resolving to 169.254.169.254 port 80: metadata address`
	if err.Error() != want {
		t.Errorf("got %q\nwant %q", err.Error(), want)
	}
	wrapped := fmt.Errorf("proxy: %w", err)
	if !errors.Is(wrapped, ErrDenied) {
		t.Error("errors.Is(wrapped, ErrDenied) = false")
	}
	err = &DeniedError{IP: netip.MustParseAddr("2002:7f00:1::1"), Class: Class6to4}
	if got := err.Error(); got != "netguard: refused 2002:7f00:1::1: 6to4 address embedding a forbidden IPv4 address" {
		t.Errorf("got %q", got)
	}
}

func BenchmarkCheck(b *testing.B) {
	exc := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
	for _, s := range []string{"8.8.8.8", "10.1.2.3", "2606:4700::1111", "64:ff9b::8.8.8.8", "::ffff:1.1.1.1"} {
		ip := netip.MustParseAddr(s)
		b.Run(s, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if Check(ip, exc) != nil {
					b.Fatal("refused")
				}
			}
		})
	}
}

func BenchmarkClassify(b *testing.B) {
	for _, s := range []string{"127.0.0.1", "255.255.255.255", "fd00:ec2::254", "2001:0:4136:e378:8000:63bf:80ff:fffe"} {
		ip := netip.MustParseAddr(s)
		b.Run(s, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				Classify(ip)
			}
		})
	}
}
