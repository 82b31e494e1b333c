//! One process per GPU, started by a launcher (torchrun's conventions, on one machine or
//! several): the environment names this process's rank and the rendezvous address, and rank 0
//! hands the NCCL unique id to every other rank over TCP there. After that, NCCL carries every
//! sum (gradients and the few host values of a step), as between the ranks of one process.
//!
//! ```text
//! WORLD_SIZE  ranks in all              RANK        this process's rank (0..WORLD_SIZE)
//! LOCAL_RANK  its GPU on this machine   MASTER_ADDR, MASTER_PORT   where rank 0 listens
//! ```

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Bytes of the id rank 0 hands out (NCCL's `ncclUniqueId`).
pub const ID_BYTES: usize = 128;

/// This process's place among the launched ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub rank: usize,
    pub world: usize,
    /// The CUDA device of this process.
    pub local_rank: usize,
    /// `MASTER_ADDR:MASTER_PORT`.
    pub rendezvous: String,
}

impl Launch {
    /// The launch the process environment describes; `None` without `WORLD_SIZE` (or with 1).
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Self::from_env`] over any lookup of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let number = |name: &str| -> Result<Option<usize>> {
            var(name)
                .map(|v| {
                    v.trim()
                        .parse()
                        .with_context(|| format!("{name}={v:?} is not a non-negative integer"))
                })
                .transpose()
        };
        let world = match number("WORLD_SIZE")? {
            None | Some(1) => return Ok(None),
            Some(0) => bail!("WORLD_SIZE=0: a launch needs at least one rank"),
            Some(world) => world,
        };
        let Some(rank) = number("RANK")? else {
            bail!(
                "WORLD_SIZE={world} is set but RANK is not: the launcher names each process's rank"
            );
        };
        if rank >= world {
            bail!("RANK={rank} is not below WORLD_SIZE={world}");
        }
        let local_rank = number("LOCAL_RANK")?.unwrap_or(rank);
        let (Some(addr), Some(port)) = (var("MASTER_ADDR"), var("MASTER_PORT")) else {
            bail!("WORLD_SIZE={world} needs MASTER_ADDR and MASTER_PORT: where rank 0 listens");
        };
        Ok(Some(Self {
            rank,
            world,
            local_rank,
            rendezvous: format!("{addr}:{port}"),
        }))
    }

    /// The NCCL unique id for every rank: rank 0 makes it with `make` and serves it at the
    /// rendezvous address until every other rank has it; the others fetch it, retrying until
    /// rank 0 listens. Gives up after `timeout`.
    pub fn share_id(
        &self,
        make: impl FnOnce() -> Result<[u8; ID_BYTES]>,
        timeout: Duration,
    ) -> Result<[u8; ID_BYTES]> {
        let deadline = Instant::now() + timeout;
        if self.rank == 0 {
            let id = make()?;
            let port = self.rendezvous.rsplit(':').next().unwrap_or_default();
            // Every interface: the others reach rank 0 by the address they were given.
            let listener = TcpListener::bind(format!("0.0.0.0:{port}"))
                .with_context(|| format!("rank 0 cannot listen on port {port} (MASTER_PORT)"))?;
            serve(&listener, self.world - 1, &id, deadline)?;
            Ok(id)
        } else {
            fetch(&self.rendezvous, self.rank, deadline)
        }
    }
}

/// Hands `id` to `peers` connections on `listener`, each of which first says its rank.
pub fn serve(
    listener: &TcpListener,
    peers: usize,
    id: &[u8; ID_BYTES],
    deadline: Instant,
) -> Result<()> {
    listener.set_nonblocking(true)?;
    let mut served = Vec::with_capacity(peers);
    while served.len() < peers {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream.set_nonblocking(false)?;
                stream.set_read_timeout(Some(Duration::from_secs(10)))?;
                let mut rank = [0u8; 4];
                stream
                    .read_exact(&mut rank)
                    .context("a rank connected and said nothing")?;
                stream.write_all(id)?;
                served.push(u32::from_le_bytes(rank));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    bail!(
                        "rank 0: {} of {peers} other ranks joined before --collective-timeout (joined: {served:?})",
                        served.len()
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e).context("rank 0: accepting a rank"),
        }
    }
    Ok(())
}

/// Fetches the id from rank 0 at `addr` as `rank`, retrying until `deadline`.
pub fn fetch(addr: &str, rank: usize, deadline: Instant) -> Result<[u8; ID_BYTES]> {
    let target = addr
        .to_socket_addrs()
        .with_context(|| format!("MASTER_ADDR:MASTER_PORT {addr}: not an address"))?
        .next()
        .with_context(|| format!("MASTER_ADDR:MASTER_PORT {addr}: no address"))?;
    loop {
        let attempt = (|| -> std::io::Result<[u8; ID_BYTES]> {
            let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(1))?;
            stream.set_read_timeout(Some(Duration::from_secs(10)))?;
            stream.write_all(&(rank as u32).to_le_bytes())?;
            let mut id = [0u8; ID_BYTES];
            stream.read_exact(&mut id)?;
            Ok(id)
        })();
        match attempt {
            Ok(id) => return Ok(id),
            Err(e) if Instant::now() >= deadline => {
                bail!(
                    "rank {rank}: rank 0 did not answer at {addr} before --collective-timeout ({e})"
                )
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn launch(vars: &[(&str, &str)]) -> Result<Option<Launch>> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Launch::from_vars(|name| vars.get(name).cloned())
    }

    #[test]
    fn the_environment_names_the_rank_and_bad_values_are_one_line_errors() {
        assert_eq!(launch(&[]).unwrap(), None);
        assert_eq!(launch(&[("WORLD_SIZE", "1")]).unwrap(), None);
        let vars = [
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        assert_eq!(
            launch(&vars).unwrap(),
            Some(Launch {
                rank: 3,
                world: 4,
                local_rank: 1,
                rendezvous: "10.0.0.1:29500".into()
            })
        );
        for (bad, says) in [
            (vec![("WORLD_SIZE", "2")], "RANK is not"),
            (vec![("WORLD_SIZE", "2"), ("RANK", "2")], "not below"),
            (vec![("WORLD_SIZE", "two")], "not a non-negative integer"),
            (vec![("WORLD_SIZE", "2"), ("RANK", "1")], "MASTER_ADDR"),
        ] {
            let error = format!("{:#}", launch(&bad).unwrap_err());
            assert!(error.contains(says) && !error.contains('\n'), "{error}");
        }
    }

    #[test]
    fn rank_0_hands_its_id_to_every_rank_and_a_missing_rank_0_times_out() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let id: [u8; ID_BYTES] = std::array::from_fn(|i| i as u8);
        let deadline = Instant::now() + Duration::from_secs(20);
        let fetched: Vec<[u8; ID_BYTES]> = std::thread::scope(|scope| {
            let ranks: Vec<_> = (1..4)
                .map(|rank| {
                    let addr = &addr;
                    scope.spawn(move || fetch(addr, rank, deadline).unwrap())
                })
                .collect();
            serve(&listener, 3, &id, deadline).unwrap();
            ranks.into_iter().map(|r| r.join().unwrap()).collect()
        });
        assert!(fetched.iter().all(|f| f == &id));

        let closed = TcpListener::bind("127.0.0.1:0").unwrap();
        let nobody = closed.local_addr().unwrap().to_string();
        drop(closed);
        let error = fetch(&nobody, 1, Instant::now() + Duration::from_millis(300)).unwrap_err();
        assert!(
            format!("{error}").contains("rank 0 did not answer"),
            "{error}"
        );
    }
}
