package netguard

import (
	"encoding/binary"
	"net/netip"
)

// Classes of addresses. Every class except ClassPublic is forbidden unless a
// per-tenant exception allows it (see Check for the classes no exception can
// unlock).
const (
	ClassPublic      = "public"
	ClassInvalid     = "invalid"     // the zero netip.Addr
	ClassZoned       = "zoned"       // an IPv6 address with a zone (%eth0): it selects an interface
	ClassUnspecified = "unspecified" // 0.0.0.0/8, ::
	ClassLoopback    = "loopback"    // 127.0.0.0/8, ::1
	ClassPrivate     = "private"     // RFC 1918
	ClassCGNAT       = "cgnat"       // 100.64.0.0/10
	ClassLinkLocal   = "link-local"  // 169.254.0.0/16, fe80::/10
	ClassMetadata    = "metadata"    // cloud instance metadata endpoints
	ClassULA         = "ula"         // fc00::/7
	ClassMulticast   = "multicast"   // 224.0.0.0/4, ff00::/8
	ClassReserved    = "reserved"    // documentation, benchmarking, future use, deprecated forms
	ClassNAT64       = "nat64"       // 64:ff9b::/96, 64:ff9b:1::/48 embedding a forbidden IPv4 address
	Class6to4        = "6to4"        // 2002::/16 embedding a forbidden IPv4 address
	ClassTeredo      = "teredo"      // 2001::/32 embedding a forbidden IPv4 address
	ClassProxySelf   = "proxy-self"  // one of the proxy's own listen addresses
)

// kind is the compact form of a class inside the tables; kind.class names it.
type kind uint8

const (
	kPublic kind = iota
	kUnspecified
	kLoopback
	kPrivate
	kCGNAT
	kLinkLocal
	kMetadata
	kULA
	kMulticast
	kReserved
	kNAT64
	k6to4
	kTeredo
)

func (k kind) class() string {
	switch k {
	case kPublic:
		return ClassPublic
	case kUnspecified:
		return ClassUnspecified
	case kLoopback:
		return ClassLoopback
	case kPrivate:
		return ClassPrivate
	case kCGNAT:
		return ClassCGNAT
	case kLinkLocal:
		return ClassLinkLocal
	case kMetadata:
		return ClassMetadata
	case kULA:
		return ClassULA
	case kMulticast:
		return ClassMulticast
	case kNAT64:
		return ClassNAT64
	case k6to4:
		return Class6to4
	case kTeredo:
		return ClassTeredo
	}
	return ClassReserved
}

// rule4 is one IPv4 prefix of the classification table. Rows are numeric and
// small so the table can be a constant literal inside a function (no package
// state, nothing parsed on the hot path) that costs next to nothing to copy; the
// comment on each row spells the prefix, and a test checks every row against
// that spelling.
type rule4 struct {
	net  uint32
	bits uint8
	kind kind
}

// embed says how an IPv6 prefix carries an IPv4 address that decides its fate.
type embed uint8

const (
	embedNone       embed = iota
	embedLast32           // NAT64 well-known prefix: the IPv4 address is the last 32 bits
	embedNAT64Local       // 64:ff9b:1::/48: only the /96 layout can be verified
	embed6to4             // 2002:AABB:CCDD::/48 embeds AA.BB.CC.DD
	embedTeredo           // 2001:0:SSSS:SSSS:flags:port:CCCC:CCCC, client bits inverted
)

// rule6 is one IPv6 prefix of the classification table (hi and lo are the two
// 64-bit halves of the prefix address).
type rule6 struct {
	hi, lo uint64
	bits   uint8
	kind   kind
	embed  embed
}

// table4 is the IPv4 classification table. First match wins, so narrower
// prefixes come before the prefixes that contain them (a test enforces this).
func table4() [21]rule4 {
	return [...]rule4{
		{0x00000000, 8, kUnspecified}, // 0.0.0.0/8
		{0x0a000000, 8, kPrivate},     // 10.0.0.0/8
		{0x646464c8, 32, kMetadata},   // 100.100.100.200/32 Alibaba Cloud metadata (inside CGNAT)
		{0x64400000, 10, kCGNAT},      // 100.64.0.0/10
		{0x7f000000, 8, kLoopback},    // 127.0.0.0/8
		{0xa83f8110, 32, kMetadata},   // 168.63.129.16/32 Azure WireServer: public, but answers only inside Azure
		{0xa9fea9fe, 32, kMetadata},   // 169.254.169.254/32
		{0xa9feaa02, 32, kMetadata},   // 169.254.170.2/32 AWS ECS task metadata
		{0xa9fe0000, 16, kLinkLocal},  // 169.254.0.0/16
		{0xac100000, 12, kPrivate},    // 172.16.0.0/12
		{0xc00000c0, 32, kMetadata},   // 192.0.0.192/32 Oracle Cloud metadata
		{0xc0000000, 24, kReserved},   // 192.0.0.0/24 IETF protocol assignments
		{0xc0000200, 24, kReserved},   // 192.0.2.0/24 TEST-NET-1
		{0xc0586300, 24, kReserved},   // 192.88.99.0/24 deprecated 6to4 relay anycast
		{0xc0a80000, 16, kPrivate},    // 192.168.0.0/16
		{0xc6120000, 15, kReserved},   // 198.18.0.0/15 benchmarking
		{0xc6336400, 24, kReserved},   // 198.51.100.0/24 TEST-NET-2
		{0xcb007100, 24, kReserved},   // 203.0.113.0/24 TEST-NET-3
		{0xe0000000, 4, kMulticast},   // 224.0.0.0/4
		{0xffffffff, 32, kReserved},   // 255.255.255.255/32 limited broadcast
		{0xf0000000, 4, kReserved},    // 240.0.0.0/4
	}
}

// table6 is the IPv6 classification table; first match wins. Anything that
// matches no row and lies outside 2000::/3 (the only space IANA allocates
// global unicast addresses from) is reserved.
func table6() [17]rule6 {
	return [...]rule6{
		{0, 0, 128, kUnspecified, embedNone},                    // ::/128
		{0, 1, 128, kLoopback, embedNone},                       // ::1/128
		{0, 0xffff0000_00000000, 96, kReserved, embedNone},      // ::ffff:0:0:0/96 IPv4-translated (SIIT)
		{0, 0, 96, kReserved, embedNone},                        // ::/96 deprecated IPv4-compatible
		{0x0064ff9b_00000000, 0, 96, kNAT64, embedLast32},       // 64:ff9b::/96
		{0x0064ff9b_00010000, 0, 48, kNAT64, embedNAT64Local},   // 64:ff9b:1::/48
		{0x01000000_00000000, 0, 64, kReserved, embedNone},      // 100::/64 discard-only
		{0x20010000_00000000, 0, 32, kTeredo, embedTeredo},      // 2001::/32
		{0x20010000_00000000, 0, 23, kReserved, embedNone},      // 2001::/23 IETF protocol assignments
		{0x20010db8_00000000, 0, 32, kReserved, embedNone},      // 2001:db8::/32 documentation
		{0x20020000_00000000, 0, 16, k6to4, embed6to4},          // 2002::/16
		{0x3fff0000_00000000, 0, 20, kReserved, embedNone},      // 3fff::/20 documentation (RFC 9637)
		{0xfd000ec2_00000000, 0x254, 128, kMetadata, embedNone}, // fd00:ec2::254/128 AWS metadata
		{0xfc000000_00000000, 0, 7, kULA, embedNone},            // fc00::/7
		{0xfe800000_00000000, 0, 10, kLinkLocal, embedNone},     // fe80::/10
		{0xfec00000_00000000, 0, 10, kReserved, embedNone},      // fec0::/10 deprecated site-local
		{0xff000000_00000000, 0, 8, kMulticast, embedNone},      // ff00::/8
	}
}

// Classify names the class of ip and says whether it is forbidden as an
// upstream destination. IPv4-mapped IPv6 addresses are unmapped first, so
// ::ffff:127.0.0.1 is "loopback". NAT64, 6to4 and Teredo addresses are
// forbidden (with their own class) when the IPv4 address they embed is.
// Classify never allocates.
func Classify(ip netip.Addr) (class string, forbidden bool) {
	if !ip.IsValid() {
		return ClassInvalid, true
	}
	ip = ip.Unmap()
	if ip.Is4() {
		return classify4(ip.As4())
	}
	// The zone does not change where the bytes point; Check refuses zoned
	// addresses separately because the zone picks the interface.
	return classify6(ip.WithZone("").As16())
}

func classify4(a [4]byte) (string, bool) {
	v := binary.BigEndian.Uint32(a[:])
	for _, r := range table4() {
		// A shift by 32 yields 0 in Go, which is the right mask for /0.
		mask := ^uint32(0) << (32 - r.bits)
		if v&mask == r.net {
			return r.kind.class(), true
		}
	}
	return ClassPublic, false
}

func classify6(a [16]byte) (string, bool) {
	hi := binary.BigEndian.Uint64(a[:8])
	lo := binary.BigEndian.Uint64(a[8:])
	for _, r := range table6() {
		if !match6(hi, lo, r.hi, r.lo, r.bits) {
			continue
		}
		if r.embed == embedNone || embeddedForbidden(a, r.embed) {
			return r.kind.class(), true
		}
		return ClassPublic, false
	}
	if hi>>61 != 0b001 { // outside 2000::/3
		return ClassReserved, true
	}
	return ClassPublic, false
}

func match6(hi, lo, phi, plo uint64, bits uint8) bool {
	if bits <= 64 {
		mask := ^uint64(0) << (64 - bits)
		return hi&mask == phi
	}
	mask := ^uint64(0) << (128 - bits)
	return hi == phi && lo&mask == plo
}

// embeddedForbidden reports whether the IPv4 address(es) carried by a is
// forbidden. When the layout cannot be verified it answers true: fail closed.
func embeddedForbidden(a [16]byte, e embed) bool {
	v4 := func(b0, b1, b2, b3 byte) bool {
		_, f := classify4([4]byte{b0, b1, b2, b3})
		return f
	}
	switch e {
	case embedLast32:
		return v4(a[12], a[13], a[14], a[15])
	case embedNAT64Local:
		// RFC 6052 allows several layouts under a local-use prefix; only the
		// /96 one (bytes 6..11 zero) says unambiguously which IPv4 address is
		// meant. Any other layout is refused rather than guessed at.
		for _, b := range a[6:12] {
			if b != 0 {
				return true
			}
		}
		return v4(a[12], a[13], a[14], a[15])
	case embed6to4:
		return v4(a[2], a[3], a[4], a[5])
	case embedTeredo:
		// The client address is the bit-inverted last 32 bits. The Teredo
		// server address (bytes 4..7) is checked too: a real one is public.
		return v4(^a[12], ^a[13], ^a[14], ^a[15]) || v4(a[4], a[5], a[6], a[7])
	}
	return true
}

// Check says whether ip may be dialled: nil if its class is public or an
// exception prefix contains it, otherwise a *DeniedError. Exceptions are the
// per-tenant prefixes from the configuration (see WithExceptions). No exception
// unlocks the unspecified address, a zoned address or an invalid one; a cloud
// metadata address is unlocked only by an exception naming exactly that one
// address (a /32 or /128), so that allowing 169.254.0.0/16 or 0.0.0.0/0 does not
// hand out instance credentials by accident.
//
// Check does not allocate when it allows; a refusal allocates its error.
func Check(ip netip.Addr, exceptions []netip.Prefix) error {
	if class, ok := checkClass(ip, exceptions); !ok {
		return &DeniedError{IP: ip, Class: class}
	}
	return nil
}

// checkClass is Check without the error value: ok reports whether ip may be
// dialled, class is its class either way.
func checkClass(ip netip.Addr, exceptions []netip.Prefix) (class string, ok bool) {
	if ip.Zone() != "" {
		return ClassZoned, false
	}
	class, forbidden := Classify(ip)
	if !forbidden {
		return class, true
	}
	switch class {
	case ClassInvalid, ClassUnspecified:
		return class, false
	}
	u := ip.Unmap()
	for _, p := range exceptions {
		p = unmapPrefix(p)
		if !p.IsValid() || !p.Contains(u) {
			continue
		}
		if class == ClassMetadata && p.Bits() != u.BitLen() {
			continue
		}
		return class, true
	}
	return class, false
}

// unmapPrefix turns ::ffff:10.0.0.0/104 into 10.0.0.0/8 so that an exception
// written in the mapped form matches the unmapped addresses Check compares.
// An IPv4-mapped prefix shorter than /96 also covers non-mapped IPv6 space and
// is returned unchanged (it then matches nothing unmapped, which fails closed).
func unmapPrefix(p netip.Prefix) netip.Prefix {
	if a := p.Addr(); a.Is4In6() && p.Bits() >= 96 {
		return netip.PrefixFrom(a.Unmap(), p.Bits()-96)
	}
	return p
}
