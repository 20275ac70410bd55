"""The spacing of a context-only copier's lookups under auto γ (prompt lookup, the suffix drafter with no
store): the shortest match worth a lookup (`price_lookup`), a lookup skipped where it surely finds
nothing (`cannot_match`), and when the row looks up next (`next_lookup`). Drafts never change what is
emitted, only how fast: these only decide when a lookup is worth its cost."""

from __future__ import annotations

from .interfaces import Proposal
from .rows import Row


def price_lookup(row: Row) -> None:
    """The row's policy tells its context-only copier the shortest match it predicts to pay
    (`SpacesLookups.set_shortest`, recalled between pricings): shorter ones are not looked for."""
    row.spaces.set_shortest(row.lookups, (("context", row.mode),), row.lookups.max_match)


def cannot_match(row: Row) -> bool:
    """Whether a context-only copier's lookup surely finds nothing: the context's trailing n-gram of the
    shortest order it looks up never occurred before (`Lookups.seen_tail`; a copy aligned through the
    prompt's rewrites counts as seen), and a longer match would end with it. Its next lookup is then set
    as that lookup finding nothing sets it (`next_lookup`), and the drafter is not asked: most lookups of
    chat and short answers find nothing, and the drafter's call (it indexes the tokens since its last
    lookup) was most of their cost."""
    order = min(row.drafter.shortest, row.drafter.orders[0])
    found = row.lookups.seen_tail(row.context, order + 1)
    if found >= order:
        return False
    look_again(row, found)
    return True


def next_lookup(row: Row, proposal: Proposal | None) -> None:
    """When the row of a context-only copier under auto γ looks up again: once its context is long enough
    that a match could have grown to the shortest length auto γ predicts to pay (`row.drafter.shortest`,
    set before the lookup). A match grows by at most one token per token the context gains (the same
    earlier occurrence, one token further on), so from a match of m tokens no copy can pay for `shortest`
    - m more tokens. None found: m is the longest trailing n-gram, of the orders not looked up, that
    occurred before (`Lookups.seen_tail`; 0 where the last token is new, as it is on about half of
    chat's steps). Where only long matches pay, or the answer's words are new, steps then skip the lookup
    and its pricing. Drafts never change what is emitted, only how fast: a match the bound misses (an
    occurrence beyond the index's CHAIN walked) costs speed."""
    if proposal is not None and proposal.match:
        look_again(row, proposal.match)
    else:
        look_again(row, row.lookups.seen_tail(row.context, min(row.drafter.shortest, row.drafter.orders[0])))


def look_again(row: Row, found: int) -> None:
    """The row's next lookup, from the match of `found` tokens its context's tail has now: once the
    context has grown enough for it to reach the shortest length that pays (`next_lookup`)."""
    row.lookup_at = len(row.context) + max(1, row.drafter.shortest - found)
