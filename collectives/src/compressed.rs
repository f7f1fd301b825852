//! Compressed allreduce (lossy): gradients quantized with MXNet's 2-bit or 1-bit codes and
//! error feedback (what quantizing left out is kept in a residual and added to the next
//! call's gradient, as MXNet's kvstore does). Every rank ends with the same bits. Two
//! schemes, chosen by [`CompressedScheme::for_call`] from the rank count and the length, so
//! that every rank chooses the same:
//!
//! - **Allgather**: the ranks allgather each one's codes of the whole buffer and each decodes
//!   and sums all of them in rank order. One quantization, but (n - 1) x size/16 bytes in
//!   per rank with 2-bit codes: past 32 ranks more than the uncompressed ring's 2(n - 1)/n.
//! - **Two phases**, as DeepSpeed's 1-bit Adam: rank j owns chunk j. Each rank quantizes
//!   every chunk with its worker residual and sends chunk j's codes to rank j (an
//!   all-to-all); rank j decodes and sums them in rank order and quantizes the sum again
//!   with its server residual (of its chunk's length) and a scale of its own
//!   (`rescaled.rs`); the chunks' codes and scales are then allgathered and decoded.
//!   2(n - 1)/n x size/16 bytes each way per rank, whatever n.

use std::future::Future;
use std::ops::Range;

use psnet_compression::Compressor;
use psnet_transport::Transport;

use crate::comm::{Communicator, Ticket};
use crate::element::{DType, ReduceOp};
use crate::error::CollectiveError;
use crate::pieces::HostPieces;
use crate::plan;
use crate::rescaled;
use crate::wire::{Call, Coll};

/// How a compressed allreduce moves its codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompressedScheme {
    /// Every rank's codes of the whole buffer go to every rank; no server residual.
    Allgather,
    /// Codes of chunk j to rank j, summed and quantized again there with a server residual
    /// of the chunk's length, then allgathered.
    TwoPhase,
}

impl CompressedScheme {
    /// The scheme for `len` float32 elements over `ranks` ranks: two phases from
    /// `two_phase_bytes` (the communicator's [`Config::compressed_two_phase_bytes`]) on more
    /// than 2 ranks. On 2 ranks both move the same bytes and the allgather quantizes once;
    /// below the size, the allgather's single latency-bound stage is the shorter.
    ///
    /// [`Config::compressed_two_phase_bytes`]: crate::Config::compressed_two_phase_bytes
    pub fn for_call(ranks: usize, len: usize, two_phase_bytes: usize) -> Self {
        if ranks > 2 && len.saturating_mul(4) >= two_phase_bytes {
            CompressedScheme::TwoPhase
        } else {
            CompressedScheme::Allgather
        }
    }
}

fn invalid(why: String) -> CollectiveError {
    CollectiveError::Invalid(format!("allreduce_compressed: {why}"))
}

impl<T: Transport> Communicator<T> {
    /// The scheme this communicator's compressed allreduce of `len` elements takes.
    pub fn compressed_scheme(&self, len: usize) -> CompressedScheme {
        CompressedScheme::for_call(self.size(), len, self.config.compressed_two_phase_bytes)
    }

    /// Elements of the server residual [`allreduce_compressed`](Self::allreduce_compressed)
    /// takes on this rank for a buffer of `len` elements: this rank's chunk with two phases,
    /// none with the allgather.
    pub fn compressed_server_residual_len(&self, len: usize) -> usize {
        match self.compressed_scheme(len) {
            CompressedScheme::Allgather => 0,
            CompressedScheme::TwoPhase => plan::chunk(len, self.size(), self.rank).len(),
        }
    }

    /// Code bytes this rank sends in one compressed allreduce of `len` elements, message
    /// headers aside: (n - 1) x the whole buffer's codes with the allgather, 2 (n - 1) x one
    /// chunk's (the longest) with two phases.
    pub fn compressed_bytes_per_rank(&self, len: usize, compressor: &dyn Compressor) -> u64 {
        let n = self.size();
        let sent = match self.compressed_scheme(len) {
            CompressedScheme::Allgather => (n - 1) * compressor.compressed_len(len),
            CompressedScheme::TwoPhase => {
                let longest = plan::chunk(len, n, 0).len();
                (n - 1) * compressor.compressed_len(longest)
                    + (n - 1) * rescaled::block_len(compressor.scheme(), longest)
            }
        };
        sent as u64
    }

    /// Sums `buf` across all ranks through `compressor`'s codes, with error feedback in
    /// `worker_residual` (`buf`'s length) and `server_residual`
    /// ([`compressed_server_residual_len`](Self::compressed_server_residual_len) elements),
    /// both zero at first and kept by the caller between calls for the same buffer. Lossy:
    /// every rank ends with the same bits; what every call applied plus every rank's
    /// residuals adds up to the sum of the gradients. Every rank must use the same scheme and
    /// threshold (a difference is a mismatch).
    pub fn allreduce_compressed<'a>(
        &'a self,
        buf: &'a mut [f32],
        worker_residual: &'a mut [f32],
        server_residual: &'a mut [f32],
        compressor: &'a dyn Compressor,
    ) -> impl Future<Output = Result<(), CollectiveError>> + Send + 'a {
        let scheme = self.compressed_scheme(buf.len());
        // Both phases take their places in the order of calls now, one after the other.
        let tickets = match scheme {
            CompressedScheme::Allgather => (self.ticket(), None),
            CompressedScheme::TwoPhase => (self.ticket(), Some(self.ticket())),
        };
        async move {
            let want_server = self.compressed_server_residual_len(buf.len());
            let checked = if worker_residual.len() != buf.len() {
                Err(invalid(format!(
                    "a worker residual of {} elements for a buffer of {}",
                    worker_residual.len(),
                    buf.len()
                )))
            } else if server_residual.len() != want_server {
                Err(invalid(format!(
                    "a server residual of {} elements where rank {} of {} takes {want_server} \
                     for a buffer of {} ({:?})",
                    server_residual.len(),
                    self.rank,
                    self.size(),
                    buf.len(),
                    scheme
                )))
            } else {
                Ok(())
            };
            match tickets {
                (first, None) => {
                    self.allgathered(first, checked, buf, worker_residual, compressor)
                        .await
                }
                (first, Some(second)) => {
                    let parts = TwoPhase {
                        buf,
                        worker: worker_residual,
                        server: server_residual,
                        compressor,
                    };
                    self.two_phase(first, second, checked, parts).await
                }
            }
        }
    }

    /// The call every rank must make alike: the scheme and the threshold's bits in `root`.
    fn compressed_call(coll: Coll, len: usize, compressor: &dyn Compressor) -> Call {
        Call {
            coll,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            count: len as u64,
            root: (compressor.scheme().factor() as u32) << 24
                ^ compressor.threshold().to_bits() >> 8,
        }
    }

    async fn allgathered(
        &self,
        ticket: Ticket<'_, T>,
        checked: Result<(), CollectiveError>,
        buf: &mut [f32],
        residual: &mut [f32],
        compressor: &dyn Compressor,
    ) -> Result<(), CollectiveError> {
        let n = self.size();
        let codes = compressor.compressed_len(buf.len());
        let mut gathered = self.scratch.bytes.take(n * codes);
        let prepared = checked
            .and_then(|()| {
                compressor
                    .quantize(
                        buf,
                        residual,
                        &mut gathered[self.rank * codes..(self.rank + 1) * codes],
                    )
                    .map_err(|e| invalid(e.to_string()))
            })
            .map(|()| {
                let call = Self::compressed_call(Coll::CompressedAllreduce, buf.len(), compressor);
                let plan =
                    plan::ring_allgather(self.rank, n, codes, 1, self.piece_elems(DType::U8));
                (call, plan)
            });
        self.run(ticket, prepared, &mut gathered).await?;
        // Rank 0's codes decoded, the others' added in rank order: the same bits as adding
        // all of them to zeros (0.0 + x is x, and a zero decodes as +0.0). 2-bit codes on
        // AVX2 take one pass over the buffer for all ranks, other kernels one per rank; a
        // pass that zeroed it first made a 64 MiB buffer on 2 ranks 2% slower than the exact
        // allreduce, here.
        let parts: Vec<&[u8]> = gathered.chunks_exact(codes.max(1)).take(n).collect();
        compressor
            .dequantize_sum(&parts, buf)
            .map_err(|e| invalid(e.to_string()))?;
        self.scratch.bytes.give(gathered);
        Ok(())
    }

    async fn two_phase(
        &self,
        first: Ticket<'_, T>,
        second: Ticket<'_, T>,
        checked: Result<(), CollectiveError>,
        parts: TwoPhase<'_>,
    ) -> Result<(), CollectiveError> {
        let TwoPhase {
            buf,
            worker,
            server,
            compressor,
        } = parts;
        let (n, rank, len) = (self.size(), self.rank, buf.len());
        let chunks: Vec<Range<usize>> = (0..n).map(|c| plan::chunk(len, n, c)).collect();
        // Every chunk's codes in a block of the longest one's (chunk 0's) length, so that both
        // phases are equal-block exchanges; the padding is never decoded.
        let block = compressor.compressed_len(chunks[0].len());
        let codes_of = |c: usize| compressor.compressed_len(chunks[c].len());
        let piece = self.piece_elems(DType::U8);

        // Phase 1: this rank's codes of chunk j to rank j.
        let mut sent = self.scratch.bytes.take(n * block);
        let mut received = self.scratch.bytes.take(n * block);
        let prepared = checked.and_then(|()| {
            for (c, range) in chunks.iter().enumerate() {
                let at = c * block;
                compressor
                    .quantize(
                        &buf[range.clone()],
                        &mut worker[range.clone()],
                        &mut sent[at..at + codes_of(c)],
                    )
                    .map_err(|e| invalid(e.to_string()))?;
            }
            let blocks = vec![block; n];
            let plan = plan::alltoall(rank, n, &blocks, &blocks, 1, piece);
            Ok((
                Self::compressed_call(Coll::CompressedScatter, len, compressor),
                plan,
            ))
        });
        let own = rank * block..(rank + 1) * block;
        received[own.clone()].copy_from_slice(&sent[own]);
        self.run_with(first, prepared, |plan| {
            Ok(HostPieces::over_two(&sent, &mut received, plan))
        })
        .await?;

        // This rank's chunk: the ranks' codes summed in rank order, quantized again with a
        // scale of its own (`rescaled.rs`).
        let mine = codes_of(rank);
        self.scratch.bytes.give(sent);
        let mut sum = self.scratch.floats.take(chunks[rank].len());
        let parts: Vec<&[u8]> = (0..n)
            .map(|from| &received[from * block..from * block + mine])
            .collect();
        compressor
            .dequantize_sum(&parts, &mut sum)
            .map_err(|e| invalid(e.to_string()))?;
        self.scratch.bytes.give(received);
        let scheme = compressor.scheme();
        let block2 = rescaled::block_len(scheme, chunks[0].len());
        let mut gathered = self.scratch.bytes.take(n * block2);
        let at = rank * block2;
        let prepared = rescaled::encode(
            scheme,
            compressor.threshold(),
            &sum,
            server,
            &mut gathered[at..at + block2],
        )
        .map_err(invalid)
        .map(|()| {
            (
                Self::compressed_call(Coll::CompressedGather, len, compressor),
                plan::ring_allgather(rank, n, block2, 1, piece),
            )
        });
        self.scratch.floats.give(sum);

        // Phase 2: every chunk's block to every rank, decoded in place.
        self.run(second, prepared, &mut gathered).await?;
        for (c, range) in chunks.iter().enumerate() {
            let at = c * block2;
            rescaled::decode(scheme, &gathered[at..at + block2], &mut buf[range.clone()])
                .map_err(|e| invalid(format!("chunk {c} (rank {c}'s): {e}")))?;
        }
        self.scratch.bytes.give(gathered);
        Ok(())
    }
}

/// What a two-phase call works on.
struct TwoPhase<'a> {
    buf: &'a mut [f32],
    worker: &'a mut [f32],
    server: &'a mut [f32],
    compressor: &'a dyn Compressor,
}
