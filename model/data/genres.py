"""Each play's genre as the First Folio (1623) catalogues it: comedy, history or tragedy.

The Folio's "Catalogue" lists 35 plays under three headings. The corpus in data/shakespeare
holds 37 plays and the poems; the genre task uses only the works the Catalogue lists:

- left out, not in the Folio: Pericles (first collected in the Third Folio, 1664), and the
  poems (the sonnets, The Rape of Lucrece, A Lover's Complaint, The Passionate
  Pilgrim, The Phoenix and the Turtle). The Two Noble Kinsmen and Venus and
  Adonis are not in the corpus.
- left out, not catalogued: Troilus and Cressida. It is printed in the Folio, between the
  histories and the tragedies, but it is missing from the Catalogue page (it was added late,
  after a rights dispute); its Folio head-title calls it a tragedy, its quarto a history,
  and editors since have called it a comedy or a "problem play". Rather than pick one we
  leave it out of the genre data.
- kept with the Folio's label where modern editors differ: Cymbeline is the Folio's last
  tragedy ("The Tragedie of Cymbeline"); The Winter's Tale is its last comedy.

Every training work, including those left out here, is still used for masked-LM pretraining.
"""

from __future__ import annotations

GENRES = ("comedy", "history", "tragedy")

FOLIO_GENRE: dict[str, str] = {
    # Comedies, in Catalogue order
    "tempest": "comedy",
    "two_gentlemen_of_verona": "comedy",
    "merry_wives_of_windsor": "comedy",
    "measure_for_measure": "comedy",
    "comedy_of_errors": "comedy",
    "much_ado_about_nothing": "comedy",
    "loves_labours_lost": "comedy",
    "midsummer_nights_dream": "comedy",
    "merchant_of_venice": "comedy",
    "as_you_like_it": "comedy",
    "taming_of_the_shrew": "comedy",
    "alls_well_that_ends_well": "comedy",
    "twelfth_night": "comedy",
    "winters_tale": "comedy",
    # Histories
    "john": "history",
    "richard_ii": "history",
    "henry_iv_part_1": "history",
    "henry_iv_part_2": "history",
    "henry_v": "history",
    "henry_vi_part_1": "history",
    "henry_vi_part_2": "history",
    "henry_vi_part_3": "history",
    "richard_iii": "history",
    "henry_viii": "history",
    # Tragedies
    "coriolanus": "tragedy",
    "tragedy_of_titus_andronicus": "tragedy",
    "romeo_and_juliet": "tragedy",
    "timon_of_athens": "tragedy",
    "julius_caesar": "tragedy",
    "macbeth": "tragedy",
    "hamlet": "tragedy",
    "lear": "tragedy",
    "othello": "tragedy",
    "antony_and_cleopatra": "tragedy",
    "cymbeline": "tragedy",
}

# Works in the corpus without a Folio genre, and why (see the module docstring).
EXCLUDED: dict[str, str] = {
    "troilus_and_cressida": "printed in the Folio but not in its Catalogue; genre disputed",
    "pericles": "not in the First Folio",
    "sonnets": "a poem, not in the First Folio",
    "rape_of_lucrece": "a poem, not in the First Folio",
    "lovers_complaint": "a poem, not in the First Folio",
    "passionate_pilgrim": "a poem, not in the First Folio",
    "phoenix_and_the_turtle": "a poem, not in the First Folio",
}
