//! Who owns the other end of a TCP connection on this machine: the uid the kernel
//! recorded for the client's socket, asked by its four addresses through
//! `NETLINK_SOCK_DIAG` (one socket looked up, whatever the machine holds), or read from
//! `/proc/net/tcp{,6}` where that is not available.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The uid owning the socket whose local end is `client` and remote end `server`.
pub fn of(client: SocketAddr, server: SocketAddr) -> Option<u32> {
    // A client of IPv4 reaching a socket of IPv6 has an IPv4 socket itself.
    let (client, server) = (unmapped(client), unmapped(server));
    if client.is_ipv4() != server.is_ipv4() {
        return None;
    }
    match by_netlink(client, server) {
        Ok(owner) => owner,
        Err(()) => by_proc(client, server),
    }
}

fn unmapped(address: SocketAddr) -> SocketAddr {
    match address.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), address.port()),
            None => address,
        },
        IpAddr::V4(_) => address,
    }
}

/// The kernel's `inet_diag_sockid`.
#[repr(C)]
#[derive(Clone, Copy)]
struct SockId {
    sport: u16,
    dport: u16,
    src: [u32; 4],
    dst: [u32; 4],
    interface: u32,
    cookie: [u32; 2],
}

/// `nlmsghdr` and `inet_diag_req_v2`.
#[repr(C)]
struct Request {
    len: u32,
    kind: u16,
    flags: u16,
    seq: u32,
    pid: u32,
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: SockId,
}

const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// Where the uid sits in an answer: after `nlmsghdr` (16 bytes), then in
/// `inet_diag_msg` after family, state, timer, retrans (4), the id (48), expires,
/// rqueue and wqueue (12).
const UID_AT: usize = 16 + 4 + 48 + 12;

/// The address's bytes as the kernel holds them (network order), in 32-bit words.
fn words(ip: IpAddr) -> [u32; 4] {
    let mut words = [0u32; 4];
    match ip {
        IpAddr::V4(v4) => words[0] = u32::from_ne_bytes(v4.octets()),
        IpAddr::V6(v6) => {
            for (word, bytes) in words.iter_mut().zip(v6.octets().chunks_exact(4)) {
                *word = u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            }
        }
    }
    words
}

/// `Ok(owner)` when the kernel answered (`None`: no such socket), `Err` when it cannot
/// be asked.
fn by_netlink(client: SocketAddr, server: SocketAddr) -> Result<Option<u32>, ()> {
    // SAFETY: a new descriptor, owned by the OwnedFd from here on.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(());
    }
    // SAFETY: `fd` is ours and open.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let request = Request {
        len: std::mem::size_of::<Request>() as u32,
        kind: SOCK_DIAG_BY_FAMILY,
        flags: libc::NLM_F_REQUEST as u16,
        seq: 1,
        pid: 0,
        family: if client.is_ipv4() {
            libc::AF_INET as u8
        } else {
            libc::AF_INET6 as u8
        },
        protocol: libc::IPPROTO_TCP as u8,
        ext: 0,
        pad: 0,
        states: u32::MAX,
        id: SockId {
            sport: client.port().to_be(),
            dport: server.port().to_be(),
            src: words(client.ip()),
            dst: words(server.ip()),
            interface: 0,
            cookie: [u32::MAX; 2],
        },
    };
    // SAFETY: an all-zero sockaddr_nl is valid; the kernel is its peer (pid 0).
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: sendto reads `request` (a repr(C) value of the length given) and `kernel`.
    let sent = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            (&raw const request).cast(),
            std::mem::size_of::<Request>(),
            0,
            (&raw const kernel).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(());
    }
    let mut answer = [0u8; 4096];
    // SAFETY: recv writes at most answer.len() bytes into `answer`. The kernel answers
    // within sendto; MSG_DONTWAIT keeps a missing answer from blocking the server.
    let got = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            answer.as_mut_ptr().cast(),
            answer.len(),
            libc::MSG_DONTWAIT,
        )
    };
    let got = usize::try_from(got).map_err(|_| ())?;
    let answer = &answer[..got];
    let kind = answer
        .get(4..6)
        .map(|b| u16::from_ne_bytes([b[0], b[1]]))
        .ok_or(())?;
    if kind == libc::NLMSG_ERROR as u16 {
        // ENOENT: no such socket; anything else: the kernel cannot be asked this way.
        let error = answer
            .get(16..20)
            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or(())?;
        return if error == -libc::ENOENT {
            Ok(None)
        } else {
            Err(())
        };
    }
    if kind != SOCK_DIAG_BY_FAMILY {
        return Err(());
    }
    let uid = answer.get(UID_AT..UID_AT + 4).ok_or(())?;
    Ok(Some(u32::from_ne_bytes([uid[0], uid[1], uid[2], uid[3]])))
}

/// The owner from `/proc/net/tcp` or `tcp6`: the line whose local end is `client` and
/// remote end `server`.
fn by_proc(client: SocketAddr, server: SocketAddr) -> Option<u32> {
    let table = if client.is_ipv4() {
        "/proc/net/tcp"
    } else {
        "/proc/net/tcp6"
    };
    let text = std::fs::read_to_string(table).ok()?;
    text.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let ours = proc_net_address(fields.get(1)?)? == client
            && proc_net_address(fields.get(2)?)? == server;
        if ours {
            fields.get(7)?.parse().ok()
        } else {
            None
        }
    })
}

/// An address of `/proc/net/tcp{,6}`: the address's bytes as the kernel holds them,
/// printed as 32-bit words in this machine's byte order, then the port (hex).
fn proc_net_address(text: &str) -> Option<SocketAddr> {
    let (address, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let mut bytes = Vec::with_capacity(16);
    for word in address.as_bytes().chunks(8) {
        let word = u32::from_str_radix(std::str::from_utf8(word).ok()?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    let ip = match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn proc_net_addresses_are_read_in_this_machines_byte_order() {
        let v4 = u32::from_ne_bytes([127, 0, 0, 2]);
        assert_eq!(
            proc_net_address(&format!("{v4:08X}:1F90")),
            Some("127.0.0.2:8080".parse().unwrap())
        );
        let one = u32::from_ne_bytes([0, 0, 0, 1]);
        assert_eq!(
            proc_net_address(&format!("000000000000000000000000{one:08X}:0050")),
            Some("[::1]:80".parse().unwrap())
        );
        assert_eq!(proc_net_address("zz:1"), None);
    }

    #[test]
    fn the_owner_of_a_local_client_is_this_process_user_both_ways_of_asking() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_served, remote) = listener.accept().unwrap();
        let local = listener.local_addr().unwrap();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert_eq!(remote, client.local_addr().unwrap());
        assert_eq!(by_netlink(remote, local), Ok(Some(me)));
        assert_eq!(by_proc(remote, local), Some(me));
        assert_eq!(of(remote, local), Some(me));
        // A port nobody uses.
        let gone = SocketAddr::new(remote.ip(), 1);
        assert_eq!(by_netlink(gone, local), Ok(None));
        assert_eq!(by_proc(gone, local), None);
    }
}
