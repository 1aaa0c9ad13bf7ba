// Package netguard answers one question: may this process open a connection to
// this IP:port?
//
// Classify and Check decide for one address, from a constant table of special
// prefixes (IPv4-mapped addresses are unmapped first; NAT64, 6to4 and Teredo
// addresses are judged by the IPv4 address they embed). Guard is the one dialer
// every upstream path of the proxy uses: it resolves names itself, checks every
// answer, dials only the addresses it checked (it never resolves twice), and its
// net.Dialer's ControlContext checks the final ip:port again, so DNS
// rebinding, numeric spellings of an address and IPv4-in-IPv6 encodings cannot
// slip past.
//
// Decisions worth knowing:
//
//   - If any resolved address is forbidden the whole dial is refused, even if
//     another answer is public: "one public, one private" is a rebinding trick,
//     and trying only the public answer would reward it.
//   - Exceptions are per tenant and travel in the context (WithExceptions);
//     there is no global "allow private". No exception unlocks the unspecified
//     address, a zoned IPv6 address or the proxy's own listen addresses, and a
//     cloud metadata address is unlocked only by an exception naming exactly
//     that address.
//   - Addresses whose layout cannot be verified (a non-/96 layout under the
//     local-use NAT64 prefix 64:ff9b:1::/48) and IPv6 outside 2000::/3 are
//     refused: fail closed.
//   - The guard is a dialer only. It never reads HTTP_PROXY and friends; an
//     http.Transport built on it must set Proxy to nil.
//   - With Options.Resolver set, every DNS query goes to that server; Go's
//     resolver still reads /etc/hosts first. Either way, every answer is checked.
package netguard
