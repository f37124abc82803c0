//! The quota's rules, each on its own.

use super::*;

fn from(source: &str) -> Holder {
    Holder {
        peer: PeerId::random(),
        source: Some(source.parse().unwrap()),
    }
}

#[tokio::test]
async fn peers_get_their_share_and_slots_come_back() {
    let quota = Quota::new(2, 3);
    let a = from("1.1.1.1");
    let b = Holder {
        peer: PeerId::random(),
        ..a
    };
    let a1 = quota.try_take(a).unwrap();
    let _a2 = quota.try_take(a).unwrap();
    assert_eq!(
        quota.try_take(a).unwrap_err(),
        Refusal::PeerFull { limit: 2 }
    );
    let _b1 = quota.try_take(b).unwrap();
    assert_eq!(quota.try_take(b).unwrap_err(), Refusal::Full { limit: 3 });
    drop(a1);
    assert_eq!(quota.in_use(), 2);
    assert!(quota.try_take(b).is_ok());
}

#[tokio::test]
async fn one_network_with_many_ids_is_cut_down_to_its_share() {
    let quota = Quota::new(4, 8);
    // Eight ids from one /24 fill the server while nobody else asks.
    let crowd: Vec<Slot> = (0..8)
        .map(|i| quota.try_take(from(&format!("6.6.6.{}", i % 3))).unwrap())
        .collect();
    let held = |slot: &Slot| quota.held().slots.contains_key(&slot.id);
    // Seven other networks get in, each at the crowd's expense, until
    // every network holds one slot; the next one waits.
    let others: Vec<Slot> = (0..7)
        .map(|i| quota.try_take(from(&format!("9.{i}.0.1"))).unwrap())
        .collect();
    assert_eq!(crowd.iter().filter(|s| held(s)).count(), 1);
    assert!(others.iter().all(held));
    assert_eq!(
        quota.try_take(from("9.100.0.1")).unwrap_err(),
        Refusal::Full { limit: 8 }
    );
    // An evicted holder hears of it.
    let gone = crowd.iter().find(|s| !held(s)).unwrap();
    tokio::time::timeout(Duration::from_secs(1), gone.evicted())
        .await
        .expect("told");
}

#[tokio::test]
async fn room_in_the_cache_comes_from_the_source_over_its_share() {
    let quota = Quota::new(4, 16);
    let crowd: Vec<Slot> = (0..3)
        .map(|_| quota.try_take(from("6.6.6.6")).unwrap())
        .collect();
    let honest = quota.try_take(from("9.9.9.9")).unwrap();
    let held = |slot: &Slot| quota.held().slots.contains_key(&slot.id);
    // While the newcomer still lacks room, the crowd gives way, down to
    // one session (what a newcomer asking for a slot would leave it).
    assert!(quota.evict_for(&honest));
    assert!(quota.evict_for(&honest));
    assert!(!quota.evict_for(&honest));
    assert!(held(&honest));
    assert_eq!(crowd.iter().filter(|s| held(s)).count(), 1);
}

#[tokio::test]
async fn hosts_share_their_network_and_stale_holders_go_first() {
    let quota = Quota::new(8, 4);
    let hog: Vec<Slot> = (0..4)
        .map(|_| quota.try_take(from("5.5.5.5")).unwrap())
        .collect();
    let held = |slot: &Slot| quota.held().slots.contains_key(&slot.id);
    // Another host of the same /24 gets in at the hog's expense.
    let neighbour = quota.try_take(from("5.5.5.6")).unwrap();
    assert_eq!(hog.iter().filter(|s| held(s)).count(), 3);
    // Later every holder but one keeps working: the stale one goes first.
    let later = Instant::now() + STALE_AFTER + Duration::from_secs(1);
    let mut left = hog.iter().filter(|s| held(s));
    let stale = left.next().unwrap();
    for slot in left.chain([&neighbour]) {
        slot.progressed_at(later);
    }
    let _second = quota.take_at(from("5.5.5.6"), later).unwrap();
    assert!(!held(stale));
    assert_eq!(quota.in_use(), 4);
    // Each host now holds two of four: nobody is over its share.
    assert_eq!(
        quota.take_at(from("5.5.5.6"), later).unwrap_err(),
        Refusal::Full { limit: 4 }
    );
}

#[tokio::test]
async fn a_long_reservation_left_idle_goes_before_a_short_one() {
    let quota = Quota::new(8, 3);
    let start = Instant::now();
    let short = quota.take_at(from("5.5.5.5"), start).unwrap();
    let long = quota.take_at(from("5.5.5.5"), start).unwrap();
    let _other = quota.take_at(from("5.5.5.6"), start).unwrap();
    short.holds(64);
    long.holds(2048);
    // Both stale; the short one has been idle longer, the long one keeps more.
    short.progressed_at(start);
    long.progressed_at(start + Duration::from_secs(2));
    let later = start + STALE_AFTER + Duration::from_secs(5);
    _other.progressed_at(later);
    let held = |slot: &Slot| quota.held().slots.contains_key(&slot.id);
    let _newcomer = quota.take_at(from("9.9.9.9"), later).unwrap();
    assert!(!held(&long), "the idle long reservation went first");
    assert!(held(&short));
}

fn held(quota: &Quota, slot: &Slot) -> bool {
    quota.held().slots.contains_key(&slot.id)
}

#[tokio::test]
async fn a_crowd_of_networks_in_one_region_gets_the_regions_share() {
    let quota = Quota::new(1, 16);
    let start = Instant::now();
    // Sixteen /24s of one /16, one session each, all working.
    let crowd: Vec<Slot> = (0..16)
        .map(|i| quota.take_at(from(&format!("6.6.{i}.1")), start).unwrap())
        .collect();
    // Clients from networks of another region get in at once, until both
    // regions hold half.
    let honest: Vec<Slot> = (0..8)
        .map(|i| quota.take_at(from(&format!("9.9.{i}.1")), start).unwrap())
        .collect();
    assert_eq!(crowd.iter().filter(|s| held(&quota, s)).count(), 8);
    assert!(honest.iter().all(|s| held(&quota, s)));
    assert_eq!(
        quota.take_at(from("9.9.100.1"), start).unwrap_err(),
        Refusal::Full { limit: 16 }
    );
}

#[tokio::test]
async fn holders_that_only_keep_alive_give_way_to_a_waiting_client() {
    let quota = Quota::new(1, 16);
    let start = Instant::now();
    // Sixteen regions hold one session each: every share is met.
    let crowd: Vec<Slot> = (0..16)
        .map(|i| {
            quota
                .take_at(from(&format!("{}.1.0.1", 10 + i)), start)
                .unwrap()
        })
        .collect();
    // While every holder works, a newcomer waits...
    let soon = start + Duration::from_secs(1);
    for slot in &crowd {
        slot.progressed_at(soon);
    }
    assert_eq!(
        quota.take_at(from("99.1.0.1"), soon).unwrap_err(),
        Refusal::Full { limit: 16 }
    );
    // ...but a crowd stepping once in a while (less often than
    // RECLAIM_AFTER) loses one session per newcomer, the idlest first,
    // while a holder mid-answer keeps its own.
    let later = soon + RECLAIM_AFTER + Duration::from_millis(500);
    crowd[0].progressed_at(later - Duration::from_millis(100));
    crowd[1].progressed_at(soon - Duration::from_millis(500));
    let newcomer = quota.take_at(from("99.1.0.1"), later).unwrap();
    assert!(!held(&quota, &crowd[1]), "the idlest gave way");
    assert!(
        held(&quota, &crowd[0]),
        "the holder mid-answer kept its slot"
    );
    assert!(held(&quota, &newcomer));
    let gone = crowd.iter().filter(|s| !held(&quota, s)).count();
    assert_eq!(gone, 1);
}

#[tokio::test]
async fn a_host_served_well_before_finds_room_kept_for_it() {
    let quota = Quota::new(1, 2);
    let start = Instant::now();
    let regular = from("20.1.0.1");
    // The regular client's first session carries an answer and ends.
    let first = quota.take_at(regular, start).unwrap();
    for step in 0..SERVED_WELL_STEPS {
        first.progressed_at(start + Duration::from_millis(u64::from(step)));
    }
    drop(first);
    // Two strangers from other regions fill the server and step every second.
    let strangers: Vec<Slot> = ["30.1.0.1", "40.1.0.1"]
        .iter()
        .map(|ip| quota.take_at(from(ip), start).unwrap())
        .collect();
    let now = start + Duration::from_secs(5);
    for slot in &strangers {
        slot.progressed_at(now - RESERVED_IDLE - Duration::from_millis(200));
    }
    // Another stranger waits: nobody is idle for RECLAIM_AFTER...
    assert_eq!(
        quota.take_at(from("50.1.0.1"), now).unwrap_err(),
        Refusal::Full { limit: 2 }
    );
    // ...the client served well before gets the idlest stranger's place.
    let again = Holder {
        peer: PeerId::random(),
        ..regular
    };
    let back = quota.take_at(again, now).unwrap();
    assert!(held(&quota, &back));
    assert_eq!(strangers.iter().filter(|s| held(&quota, s)).count(), 1);
}
