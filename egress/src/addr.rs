//! Address classes the proxy never connects to, checked on the address actually connected to
//! (after resolution, so a name that resolves to an internal address is refused: DNS
//! rebinding).
//!
//! Sources: RFC 6890 (special-purpose registries), RFC 1918 (private IPv4), RFC 6598 (CGNAT
//! 100.64.0.0/10), RFC 3927 and RFC 4291 (link-local; 169.254.169.254 is the cloud metadata
//! address of AWS, GCP, Azure and OpenStack), RFC 4193 (IPv6 unique-local fc00::/7), RFC 4291
//! section 2.5.5.2 (IPv4-mapped `::ffff:a.b.c.d`), RFC 6052 (NAT64 `64:ff9b::/96`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Why an address is refused: the class it falls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// 0.0.0.0/8, `::`.
    Unspecified,
    /// 127.0.0.0/8, `::1`.
    Loopback,
    /// 10/8, 172.16/12, 192.168/16.
    Private,
    /// 100.64.0.0/10.
    Cgnat,
    /// 169.254.169.254 and fd00:ec2::254 (cloud instance metadata).
    Metadata,
    /// 169.254/16, fe80::/10.
    LinkLocal,
    /// fc00::/7.
    UniqueLocal,
    /// 224/4, ff00::/8.
    Multicast,
    /// 240/4 and 255.255.255.255, 192.0.0.0/24, documentation ranges, benchmarking
    /// (198.18/15), discard-only and other special-purpose ranges of RFC 6890.
    Reserved,
}

impl Class {
    /// The class as the refusal's reason says it.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Unspecified => "unspecified",
            Class::Loopback => "loopback",
            Class::Private => "private",
            Class::Cgnat => "carrier-grade NAT",
            Class::Metadata => "cloud metadata",
            Class::LinkLocal => "link-local",
            Class::UniqueLocal => "unique-local",
            Class::Multicast => "multicast",
            Class::Reserved => "reserved",
        }
    }
}

/// The refused class of `ip`, `None` for a global unicast address.
pub fn refused(ip: IpAddr) -> Option<Class> {
    match ip {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => refused_v6(v6),
    }
}

fn refused_v4(ip: Ipv4Addr) -> Option<Class> {
    let [a, b, c, _] = ip.octets();
    let class = match (a, b, c) {
        _ if ip == Ipv4Addr::new(169, 254, 169, 254) => Class::Metadata,
        (0, _, _) => Class::Unspecified,
        (127, _, _) => Class::Loopback,
        (10, _, _) => Class::Private,
        (172, 16..=31, _) => Class::Private,
        (192, 168, _) => Class::Private,
        (100, 64..=127, _) => Class::Cgnat,
        (169, 254, _) => Class::LinkLocal,
        (224..=239, _, _) => Class::Multicast,
        (240..=255, _, _) => Class::Reserved,
        (192, 0, 0) | (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => Class::Reserved,
        (198, 18..=19, _) => Class::Reserved,
        (192, 88, 99) => Class::Reserved,
        _ => return None,
    };
    Some(class)
}

fn refused_v6(ip: Ipv6Addr) -> Option<Class> {
    // IPv4-mapped (::ffff:a.b.c.d), IPv4-compatible (::a.b.c.d, deprecated) and NAT64
    // (64:ff9b::a.b.c.d) addresses reach the IPv4 address inside: judge that one.
    let s = ip.segments();
    if let Some(v4) = ip.to_ipv4_mapped() {
        return refused_v4(v4);
    }
    if s[..6] == [0, 0, 0, 0, 0, 0] && !ip.is_unspecified() && !ip.is_loopback() {
        return refused_v4(Ipv4Addr::from(((s[6] as u32) << 16) | s[7] as u32))
            .or(Some(Class::Reserved));
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return refused_v4(Ipv4Addr::from(((s[6] as u32) << 16) | s[7] as u32));
    }
    let class = match s[0] {
        _ if ip.is_unspecified() => Class::Unspecified,
        _ if ip.is_loopback() => Class::Loopback,
        _ if s[..3] == [0xfd00, 0x0ec2, 0] && s[3..7] == [0, 0, 0, 0] && s[7] == 0x254 => {
            Class::Metadata
        }
        x if x & 0xfe00 == 0xfc00 => Class::UniqueLocal,
        x if x & 0xffc0 == 0xfe80 => Class::LinkLocal,
        x if x & 0xffc0 == 0xfec0 => Class::LinkLocal, // deprecated site-local
        x if x & 0xff00 == 0xff00 => Class::Multicast,
        0x2001 if s[1] == 0x0db8 => Class::Reserved, // documentation
        0x0100 if s[1..4] == [0, 0, 0] => Class::Reserved, // discard-only
        // NAT64 local-use prefix (RFC 8215, 64:ff9b:1::/48): its IPv4 embedding is the
        // operator's choice, so any IPv4 address may be inside.
        0x0064 if s[1] == 0xff9b && s[2] == 1 => Class::Reserved,
        // IPv4-translated (::ffff:0:a.b.c.d, RFC 2765): likewise an IPv4 address of any class.
        0 if s[..5] == [0, 0, 0, 0, 0xffff] && s[5] == 0 => Class::Reserved,
        0x2002 => Class::Reserved, // 6to4: an embedded IPv4 address of any class
        0x2001 if s[1] == 0 => Class::Reserved, // Teredo: likewise
        _ => return None,
    };
    Some(class)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> Option<Class> {
        refused(s.parse().unwrap())
    }

    #[test]
    fn internal_v4_refused() {
        assert_eq!(c("127.0.0.1"), Some(Class::Loopback));
        assert_eq!(c("127.255.0.9"), Some(Class::Loopback));
        assert_eq!(c("0.0.0.0"), Some(Class::Unspecified));
        assert_eq!(c("10.1.2.3"), Some(Class::Private));
        assert_eq!(c("172.16.0.1"), Some(Class::Private));
        assert_eq!(c("172.31.255.255"), Some(Class::Private));
        assert_eq!(c("192.168.1.1"), Some(Class::Private));
        assert_eq!(c("100.64.0.1"), Some(Class::Cgnat));
        assert_eq!(c("100.127.255.255"), Some(Class::Cgnat));
        assert_eq!(c("169.254.169.254"), Some(Class::Metadata));
        assert_eq!(c("169.254.1.1"), Some(Class::LinkLocal));
        assert_eq!(c("224.0.0.1"), Some(Class::Multicast));
        assert_eq!(c("255.255.255.255"), Some(Class::Reserved));
        assert_eq!(c("192.0.2.5"), Some(Class::Reserved));
    }

    #[test]
    fn public_v4_allowed() {
        for a in [
            "1.1.1.1",
            "8.8.8.8",
            "151.101.0.223",
            "172.15.255.255",
            "172.32.0.1",
            "100.63.255.255",
            "100.128.0.0",
            "169.253.0.1",
            "11.0.0.1",
        ] {
            assert_eq!(c(a), None, "{a}");
        }
    }

    #[test]
    fn v6_and_mapped_forms() {
        assert_eq!(c("::1"), Some(Class::Loopback));
        assert_eq!(c("::"), Some(Class::Unspecified));
        assert_eq!(c("fe80::1"), Some(Class::LinkLocal));
        assert_eq!(c("fd12:3456::1"), Some(Class::UniqueLocal));
        assert_eq!(c("fc00::1"), Some(Class::UniqueLocal));
        assert_eq!(c("ff02::1"), Some(Class::Multicast));
        assert_eq!(c("fd00:ec2::254"), Some(Class::Metadata));
        assert_eq!(c("::ffff:127.0.0.1"), Some(Class::Loopback));
        assert_eq!(c("::ffff:10.0.0.1"), Some(Class::Private));
        assert_eq!(c("::ffff:169.254.169.254"), Some(Class::Metadata));
        assert_eq!(c("::127.0.0.1"), Some(Class::Loopback));
        assert_eq!(c("64:ff9b::a9fe:a9fe"), Some(Class::Metadata));
        assert_eq!(c("2001:db8::1"), Some(Class::Reserved));
        assert_eq!(c("2002:7f00:1::1"), Some(Class::Reserved));
        assert_eq!(c("2606:4700::1111"), None);
        assert_eq!(c("::ffff:1.1.1.1"), None);
        assert_eq!(c("64:ff9b::101:101"), None);
        assert_eq!(c("64:ff9b:1::a9fe:a9fe"), Some(Class::Reserved));
        assert_eq!(c("64:ff9b:1:ffff::101:101"), Some(Class::Reserved));
        assert_eq!(c("::ffff:0:a9fe:a9fe"), Some(Class::Reserved));
        assert_eq!(c("::ffff:0:101:101"), Some(Class::Reserved));
    }
}
